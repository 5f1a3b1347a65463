"""`opkd train`: on-policy distillation, single process or SPMD under torchrun.

    opkd train --config configs/x.yaml [--resume | --overwrite] [key.path=value ...]
    torchrun --nproc_per_node 2 -m opkd_mcore.cli train --config configs/x.yaml parallel.tp=2
    opkd train --config configs/x.yaml controller.kind=ray run.schedule=async   (docs/controller.md)

Each step: prompts -> rollout (vLLM, n per prompt) -> teacher scoring -> student update (Megatron,
packed micro-batches, vocab-parallel loss) -> weight sync into the rollout engine.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from opkd_mcore.config import ConfigError, dump_config, load_config
from opkd_mcore.train.checkpoint import prepare_run_dir, save_checkpoint
from opkd_mcore.train.components import build_run, close_run, is_rank0
from opkd_mcore.train.metrics import MetricsLogger


def parse_args(argv):
    p = argparse.ArgumentParser(prog="opkd train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh, deleting the checkpoints in output_dir (= run.overwrite=true)")
    p.add_argument("--export-only", action="store_true",
                   help="load the latest checkpoint, write <output_dir>/student_hf, and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loss.divergence=jsd")
    return p.parse_args(argv)


def train(cfg, *, resume: bool = False, export_only: bool = False, step_hook=None) -> list[dict]:
    """Run (or continue) the distillation of `cfg`; returns the per-step metrics (all ranks).

    `step_hook(run, step) -> dict` (optional) adds metrics after each step (the demo's evaluation).
    """
    from opkd_mcore.models import save_hf_checkpoint
    from opkd_mcore.train.samples_log import SamplesLog

    if cfg.controller.kind == "ray":  # worker groups as Ray actors, any schedule (controller/)
        from opkd_mcore.controller import train_with_ray

        return train_with_ray(cfg, resume=resume, export_only=export_only)
    out = cfg.run.output_dir
    config_yaml = dump_config(cfg)
    # before any engine starts: refuse what the output directory cannot serve, modifying nothing
    prepare_run_dir(cfg, resume=resume, export_only=export_only)
    run = build_run(cfg, resume=resume or export_only)
    log = MetricsLogger(out, cfg.logging, cfg.run.steps, start_step=run.state.step,
                        enabled=is_rank0() and not export_only)
    run.samples_log = SamplesLog(out, start_step=run.state.step, enabled=is_rank0() and not export_only)
    if is_rank0():
        dump_config(cfg, os.path.join(out, "config.yaml"))
    history = []
    ckpt = cfg.checkpoint
    while run.state.step < cfg.run.steps and not export_only:
        step = run.state.step
        metrics = run.step()
        if step_hook is not None:
            metrics.update(step_hook(run, step) or {})
        log.log(step, metrics)
        history.append({"step": step, **metrics})
        if ckpt.save_every and run.state.step % ckpt.save_every == 0:
            save_checkpoint(out, run.engine, run.state, config_yaml, ckpt.keep_last)
    if ckpt.save_at_end and not export_only and history and (
            not ckpt.save_every or run.state.step % ckpt.save_every):
        save_checkpoint(out, run.engine, run.state, config_yaml, ckpt.keep_last)
    if ckpt.export_hf_at_end or export_only:
        save_hf_checkpoint(run.chunks, os.path.join(out, "student_hf"), src_hf_dir=cfg.model.student)
    log.close()
    close_run(run)
    return history


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides + (["run.overwrite=true"] if args.overwrite else []))
    except (ConfigError, FileNotFoundError) as err:
        # a config problem is the user's to fix: the message names the key, a traceback adds nothing
        print(f"opkd train: error: {err}", file=sys.stderr)
        return 2
    if is_rank0():
        print(dump_config(cfg))
    try:
        train(cfg, resume=args.resume, export_only=args.export_only)
    except ConfigError as err:  # raised before anything started or changed (ResumeError, loss.impl)
        print(f"opkd train: error: {err}", file=sys.stderr)
        return 2
    return 0
