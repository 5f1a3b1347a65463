"""`opkd train`: on-policy distillation, single process or SPMD under torchrun, or under the Ray controller.

    opkd train --config configs/x.yaml [--resume | --overwrite] [key.path=value ...]
    opkd train --check --config configs/x.yaml [key.path=value ...]   (check only: starts nothing)
    torchrun --nproc_per_node 2 -m opkd_mcore.cli train --config configs/x.yaml parallel.tp=2
    opkd train --config configs/x.yaml controller.kind=ray run.schedule=async   (docs/controller.md)

`controller.kind` picks who runs the stages: this SPMD job (`train/spmd.py`) or the Ray
controller's worker groups (`controller/`). Before either starts anything, the start-up checks of
`train/preflight.py` run (models, tokenizer, prompts, output directory, teacher servers).
"""
from __future__ import annotations

import argparse
import logging
import sys

from opkd_mcore.config import ConfigError, dump_config, load_config
from opkd_mcore.controller import train_with_ray
from opkd_mcore.platform import is_rank0
from opkd_mcore.train.preflight import preflight
from opkd_mcore.train.spmd import train_spmd


def parse_args(argv):
    p = argparse.ArgumentParser(prog="opkd train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh, removing an earlier run's output in output_dir (checkpoints/, "
                        "metrics.jsonl, samples.jsonl, student_hf/, config.yaml, tensorboard/; nothing else)")
    p.add_argument("--export-only", action="store_true",
                   help="load the latest checkpoint, write <output_dir>/student_hf, and exit")
    p.add_argument("--check", action="store_true",
                   help="check the config, models, tokenizer, data, output directory and teacher servers, "
                        "print the resolved config, and exit (0: ready, 2: the errors); starts and writes "
                        "nothing")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loss.divergence=jsd")
    return p.parse_args(argv)


def train(cfg, *, resume: bool = False, export_only: bool = False, overwrite: bool = False,
          step_hook=None) -> list[dict]:
    """Run (or continue) the distillation of `cfg` with its controller; returns the per-step metrics.
    `overwrite`: a fresh run replaces an earlier run's output in `run.output_dir` (never part of a
    config: one command line asks for it). `step_hook(run, step) -> dict` adds metrics after each
    step (SPMD only: the demo's evaluation)."""
    if cfg.controller.kind == "ray":
        if step_hook is not None:
            raise ValueError("step_hook: the Ray controller's steps run in actors; no hook reaches them")
        return train_with_ray(cfg, resume=resume, export_only=export_only, overwrite=overwrite)
    return train_spmd(cfg, resume=resume, export_only=export_only, overwrite=overwrite, step_hook=step_hook)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        # a config problem is the user's to fix: the message names the key, a traceback adds nothing
        missing = isinstance(err, FileNotFoundError) and err.filename == args.config
        print(f"opkd train: error: {f'--config: no such file {args.config!r}' if missing else err}",
              file=sys.stderr)
        return 2
    if is_rank0():
        print(dump_config(cfg))
    try:
        # every rank checks what it reads itself; rank 0 alone asks the teacher servers (one probe
        # per server, not one per rank)
        preflight(cfg, resume=args.resume, export_only=args.export_only, overwrite=args.overwrite,
                  probe_servers=is_rank0(), check_prompts=args.check)
    except ConfigError as err:
        for line in str(err).splitlines():
            print(f"opkd train: error: {line}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    try:
        train(cfg, resume=args.resume, export_only=args.export_only, overwrite=args.overwrite)
    except ConfigError as err:  # raised before anything started or changed (ResumeError, loss.impl)
        print(f"opkd train: error: {err}", file=sys.stderr)
        return 2
    return 0
