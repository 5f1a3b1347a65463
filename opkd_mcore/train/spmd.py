"""The torchrun (SPMD) run of `opkd train`: build the run's parts on every rank, step, checkpoint, export.

Each step: prompts -> rollout (vLLM, n per prompt) -> teacher scoring -> student update (Megatron,
packed micro-batches, vocab-parallel loss) -> weight sync into the rollout engine.
"""
from __future__ import annotations

import os

from opkd_mcore.config import dump_config
from opkd_mcore.models import save_hf_checkpoint
from opkd_mcore.platform import is_rank0
from opkd_mcore.train.checkpoint import EXPORT_DIR, prepare_run_dir, save_checkpoint
from opkd_mcore.train.components import build_run, close_run
from opkd_mcore.train.metrics import MetricsLogger, step_profile
from opkd_mcore.train.samples_log import SamplesLog


def train_spmd(cfg, *, resume: bool = False, export_only: bool = False, overwrite: bool = False,
               step_hook=None) -> list[dict]:
    """Run (or continue) the distillation of `cfg` in this SPMD job; returns the per-step metrics (all ranks).

    `overwrite` (a fresh run only) replaces an earlier run's output in `run.output_dir`.
    `step_hook(run, step) -> dict` (optional) adds metrics after each step (the demo's evaluation).
    """
    out = cfg.run.output_dir
    config_yaml = dump_config(cfg)
    # before any engine starts: refuse what the output directory cannot serve (modifying nothing),
    # then remove what --overwrite replaces
    prepare_run_dir(cfg, resume=resume, export_only=export_only, overwrite=overwrite)
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
        with step_profile(cfg.logging, out, step):
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
        run.engine.fresh_params()
        save_hf_checkpoint(run.chunks, os.path.join(out, EXPORT_DIR), src_hf_dir=cfg.model.student)
    log.close()
    close_run(run)
    return history


