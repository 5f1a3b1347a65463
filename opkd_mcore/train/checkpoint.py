"""Checkpoints of a distillation run and `--resume`.

    <output_dir>/checkpoints/step_000012/
        engine/               student model + optimizer + LR schedule (Megatron dist checkpoint)
        trainer_state.json    step, weight version, data-sampler position
        rng/rank_00000.pt     every RNG state of each rank (platform.rng_state)
        config.yaml           the resolved config the checkpoint was written with
    <output_dir>/checkpoints/latest   name of the newest complete checkpoint

`latest` is written last (after every rank has finished), so a run killed mid-save resumes
from the previous complete checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from opkd_mcore.platform.rng_state import capture_rng_states, restore_rng_states

logger = logging.getLogger(__name__)

LATEST = "latest"


@dataclass
class TrainerState:
    """What besides model and optimizer is needed to continue a run exactly."""

    step: int = 0  # optimizer steps completed
    weight_version: int = 0  # version of the weights the rollout engine holds
    sampler: dict = field(default_factory=dict)  # PromptSampler.state_dict()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def save_checkpoint(output_dir: str, engine, state: TrainerState, config_yaml: str,
                    keep_last: int = 2) -> str:
    """Write a checkpoint of step `state.step` (collective: every rank calls it)."""
    root = checkpoint_root(output_dir)
    name = f"step_{state.step:06d}"
    path = os.path.join(root, name)
    if _rank() == 0:
        if os.path.isdir(path):  # a partial save of the same step from a killed run
            shutil.rmtree(path)
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    _barrier()
    engine.save_checkpoint(os.path.join(path, "engine"))
    torch.save(capture_rng_states(), os.path.join(path, "rng", f"rank_{_rank():05d}.pt"))
    if _rank() == 0:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump(asdict(state), f, indent=2)
        with open(os.path.join(path, "config.yaml"), "w") as f:
            f.write(config_yaml)
    _barrier()
    if _rank() == 0:
        tmp = os.path.join(root, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(name)
        os.replace(tmp, os.path.join(root, LATEST))
        _prune(root, keep_last)
    _barrier()
    logger.info("saved checkpoint %s", path)
    return path


def _prune(root: str, keep_last: int) -> None:
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for old in steps[:-keep_last]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def latest_checkpoint(output_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    marker = os.path.join(checkpoint_root(output_dir), LATEST)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        path = os.path.join(checkpoint_root(output_dir), f.read().strip())
    return path if os.path.isdir(path) else None


def load_checkpoint(path: str, engine) -> TrainerState:
    """Restore engine (model, optimizer, schedule), RNG states; return the trainer state."""
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ValueError(f"checkpoint {path!r}: no trainer_state.json (not a complete checkpoint)")
    engine.load_checkpoint(os.path.join(path, "engine"))
    rng_file = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
    if os.path.isfile(rng_file):
        restore_rng_states(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("checkpoint %s has no RNG state for rank %d (different world size?)", path, _rank())
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = TrainerState(**json.load(f))
    logger.info("resumed from %s (step %d, weight version %d)", path, state.step, state.weight_version)
    return state
