"""Checkpoints of a distillation run, `--resume` and `--overwrite`.

    <output_dir>/checkpoints/step_000012/
        engine/               student model + optimizer + LR schedule (Megatron dist checkpoint)
        trainer_state.json    step, weight version, data-sampler position
        rng/rank_00000.pt     every RNG state of each rank (platform.rng_state)
        config.yaml           the resolved config the checkpoint was written with
    <output_dir>/checkpoints/latest   name of the newest complete checkpoint

Every file is fsynced before `latest` names its checkpoint, and `latest` is replaced atomically
(after every rank has finished), so a run killed mid-save, or a machine losing power, resumes from
the previous complete checkpoint.

Before anything starts, `prepare_run_dir` decides what the output directory means: a fresh run
refuses one that already holds checkpoints (unless `run.overwrite`), `--resume` needs a checkpoint,
and a resumed config may change only settings that leave the results unchanged.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import yaml

from opkd_mcore.config import ConfigError, from_dict, to_dict
from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.platform import global_rank
from opkd_mcore.platform.rng_state import capture_rng_states, restore_rng_states
from opkd_mcore.train.metrics import METRICS_FILE

logger = logging.getLogger(__name__)

LATEST = "latest"
STEP_PREFIX = "step_"


class ResumeError(ConfigError):
    """The output directory cannot serve the request (fresh run, --resume, --export-only)."""


@dataclass
class TrainerState:
    """What besides model and optimizer is needed to continue a run exactly."""

    step: int = 0  # optimizer steps completed
    weight_version: int = 0  # version of the weights the rollout engine holds
    sampler: dict = field(default_factory=dict)  # PromptSampler.state_dict()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


# ------------------------------------------------------------------ durable writes


def _fsync_path(path: str) -> None:
    """fsync a file or directory (a directory's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _save_torch(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: str) -> None:
    """fsync what this rank can see under `root`, files before the directories holding them.
    Megatron fsyncs the shards it writes; this covers its small metadata files and the names."""
    for here, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(os.path.join(here, name))
        _fsync_path(here)


def _point_latest(root: str, name: str) -> None:
    """Make `root/latest` name `name`: write a temporary file, fsync, rename, fsync the directory."""
    tmp = os.path.join(root, LATEST + ".tmp")
    _write_text(tmp, name)
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_path(root)


# ------------------------------------------------------------------ save


def save_checkpoint(output_dir: str, engine, state: TrainerState, config_yaml: str,
                    keep_last: int = 2) -> str:
    """Write a checkpoint of step `state.step` (collective: every rank calls it)."""
    root = checkpoint_root(output_dir)
    name = f"{STEP_PREFIX}{state.step:06d}"
    path = os.path.join(root, name)
    if global_rank() == 0:
        if os.path.isdir(path):  # a partial save of the same step from a killed run
            shutil.rmtree(path)
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    _barrier()
    engine.save_checkpoint(os.path.join(path, "engine"))
    _save_torch(capture_rng_states(), os.path.join(path, "rng", f"rank_{global_rank():05d}.pt"))
    if global_rank() == 0:
        _write_text(os.path.join(path, "trainer_state.json"), json.dumps(asdict(state), indent=2))
        _write_text(os.path.join(path, "config.yaml"), config_yaml)
    _barrier()
    if global_rank() == 0:
        _fsync_tree(os.path.join(path, "engine"))
        _fsync_path(os.path.join(path, "rng"))
        _fsync_path(path)
        _point_latest(root, name)
        _prune(root, keep_last, name)
    _barrier()
    logger.info("saved checkpoint %s", path)
    return path


def _step_of(name: str) -> int | None:
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def _prune(root: str, keep_last: int, latest: str) -> None:
    """Keep `latest` and the `keep_last - 1` checkpoints before it (by step number, not by name).

    Never removes `latest` nor a checkpoint of a higher step: such a directory was not written
    by this run (a partial save of a killed run, say), and the one just written must survive.
    """
    latest_step = _step_of(latest)
    older = sorted((step, d) for d in os.listdir(root)
                   if (step := _step_of(d)) is not None and step < latest_step)
    for _, old in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


# ------------------------------------------------------------------ find / check before a run


def latest_checkpoint(output_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    marker = os.path.join(checkpoint_root(output_dir), LATEST)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        path = os.path.join(checkpoint_root(output_dir), f.read().strip())
    return path if os.path.isfile(os.path.join(path, "trainer_state.json")) else None


def require_checkpoint(output_dir: str, flag: str = "--resume") -> str:
    """The checkpoint `flag` continues from; `ResumeError` naming the directory when there is none."""
    path = latest_checkpoint(output_dir)
    if path is None:
        raise ResumeError(f"{flag}: no complete checkpoint under {checkpoint_root(output_dir)} (its "
                          f"`{LATEST}` pointer is missing or names no checkpoint with trainer_state.json); "
                          "start a fresh run without it")
    return path


def prepare_run_dir(cfg: TrainConfig, *, resume: bool, export_only: bool = False) -> str | None:
    """Check the output directory before any engine starts; return the checkpoint to continue.

    --resume / --export-only: the latest complete checkpoint, with the config compared to the one
    it was written with. A fresh run: None; a directory that already holds checkpoints is refused
    unless `run.overwrite`, which removes them (and metrics.jsonl) first. Nothing else is modified,
    and nothing at all when a `ResumeError` is raised.
    """
    out = cfg.run.output_dir
    if resume or export_only:
        flag = "--export-only" if export_only else "--resume"
        path = require_checkpoint(out, flag)
        check_resumed_config(path, cfg, export_only=export_only)
        if cfg.run.overwrite:
            logger.warning("%s: run.overwrite ignored, continuing from %s", flag, path)
        return path
    root = checkpoint_root(out)
    try:
        existing = sorted(os.listdir(root))
    except FileNotFoundError:  # none yet, or rank 0 is removing it for run.overwrite right now
        existing = []
    if not existing:
        return None
    if not cfg.run.overwrite:
        raise ResumeError(f"run.output_dir: {root} already holds checkpoints of an earlier run "
                          f"({', '.join(existing[:4])}); continue it with --resume, or replace it with "
                          "--overwrite (run.overwrite=true)")
    if global_rank() == 0:  # the other ranks see the same directory; one removes it
        logger.warning("run.overwrite: removing %s and the old %s", root, METRICS_FILE)
        shutil.rmtree(root)
        if os.path.exists(os.path.join(out, METRICS_FILE)):
            os.remove(os.path.join(out, METRICS_FILE))
    return None


def check_run_dir(cfg: TrainConfig, *, resume: bool, export_only: bool = False,
                  overwrite: bool = False) -> str | None:
    """What `prepare_run_dir` checks, modifying nothing (`opkd train --check`, the start-up checks):
    the checkpoint to continue, or None for a fresh run; `ResumeError` when the directory cannot serve."""
    out = cfg.run.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ResumeError(f"run.output_dir: {out} is an existing file; expected a directory (or a path "
                          "to create one at)")
    if resume or export_only:
        path = require_checkpoint(out, "--export-only" if export_only else "--resume")
        check_resumed_config(path, cfg, export_only=export_only)
        return path
    root = checkpoint_root(out)
    try:
        existing = sorted(os.listdir(root))
    except FileNotFoundError:  # none yet, or rank 0 is already removing it for run.overwrite
        existing = []
    if existing and not (overwrite or cfg.run.overwrite):
        raise ResumeError(f"run.output_dir: {root} already holds checkpoints of an earlier run "
                          f"({', '.join(existing[:4])}); continue it with --resume, or replace it with "
                          "--overwrite (run.overwrite=true)")
    return None


# ------------------------------------------------------------------ resumed config vs saved config

# A resumed run may change these: they say where and how the work runs, or how it is reported,
# never what is computed. `run.steps` is here, but when the LR decay length defaults to it the
# change shows up as `optim.lr_decay_steps` (refused). TP/PP/VPP/CP/EP are here because Megatron
# dist checkpoints load into any layout (results equal up to float rounding), except with the
# distributed optimizer, whose checkpoint needs the same layout (`LAYOUT_KEYS`).
RESUMABLE_KEYS = (
    "run.steps", "run.output_dir", "run.overwrite", "run.device",
    "logging.*", "checkpoint.*",
    "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.etp",
    "parallel.world_size",
    "teacher.teachers.*.url", "teacher.teachers.*.replica_urls", "teacher.teachers.*.offload",
    "weight_sync.host", "weight_sync.bucket_mb", "weight_sync.transport", "weight_sync.tp_export",
    "weight_sync.high_priority_stream",
    "rollout.gpu_memory_utilization", "rollout.enforce_eager",
    "loss.impl",  # reference or fused kernels: the same loss
    "optim.overlap_grad_reduce",
    # who runs the stages and where (the schedule, a result key, decides what overlaps); a torchrun
    # `sync` checkpoint and a Ray `sync` one hold the same state (nothing in flight)
    "controller.*",
)
# These change the numbers a run produces (and an unlisted key is treated the same way): the
# model, batch shapes, objective, optimizer (including the checkpoint layout of the distributed
# optimizer), data and its order, rollout sampling, teachers and what they return, sync cadence.
RESULT_KEYS = (
    "model.*", "parallel.micro_batch_size", "parallel.global_batch_size", "loss.*", "optim.*",
    "data.*", "rollout.*", "teacher.*", "weight_sync.every_steps", "run.seed", "run.schedule",
    "run.max_staleness", "run.stale_policy", "run.is_truncation", "run.in_flight_update",
    "run.partial_rollout_tokens",
)
LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.etp")


class _Absent:
    """A key one of the two configs does not have."""

    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def classify_key(key: str) -> str | None:
    """"resumable", "result", or None for a key neither list names (treated as "result")."""
    if any(fnmatch(key, pattern) for pattern in RESUMABLE_KEYS):
        return "resumable"
    if any(fnmatch(key, pattern) for pattern in RESULT_KEYS):
        return "result"
    return None


def flat_config(tree, prefix: str = "") -> dict:
    """{"a.b.0.c": value} of a nested config dict; lists of sections are indexed, other lists are values."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list) and tree and all(isinstance(x, dict) for x in tree):
        items = enumerate(tree)
    else:
        return {prefix[:-1]: tree}
    flat = {}
    for key, value in items:
        flat.update(flat_config(value, f"{prefix}{key}."))
    return flat


def _effective(flat: dict) -> tuple[dict, dict]:
    """The config as the trainer uses it (`components.optim_config`), with notes for the message."""
    flat, notes = dict(flat), {}
    if flat.get("optim.lr_decay_style") != "constant" and flat.get("optim.lr_decay_steps") is None:
        flat["optim.lr_decay_steps"] = flat.get("run.steps")
        notes["optim.lr_decay_steps"] = " (null: run.steps)"
    return flat, notes


def _load_saved_config(path: str) -> dict | None:
    file = os.path.join(path, "config.yaml")
    if not os.path.isfile(file):
        logger.warning("%s has no config.yaml: the resumed config is not compared with it", path)
        return None
    with open(file) as f:
        tree = yaml.safe_load(f) or {}
    try:  # through the schema: keys added since the save take their defaults
        return to_dict(from_dict(TrainConfig, tree))
    except ConfigError as err:
        raise ResumeError(f"--resume: {file} does not fit this version's config schema ({err}); "
                          "edit it to match, or start a new run") from None


def _refused(key: str, layout_fixed: bool, model_only: bool) -> str | None:
    """Why a change of `key` is refused, or None when it is allowed."""
    if layout_fixed and key in LAYOUT_KEYS:
        return " (the distributed optimizer's checkpoint needs the same layout)"
    if model_only:
        return "" if fnmatch(key, "model.*") else None
    return None if classify_key(key) == "resumable" else ""


def config_changes(saved: dict, current: dict, *, model_only: bool = False) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences of two config dicts, one "key: old in the checkpoint, new now"
    line each. `model_only` (an export) refuses only what the checkpoint cannot load into."""
    (old, old_notes), (new, new_notes) = _effective(flat_config(saved)), _effective(flat_config(current))
    distributed = "optim.use_distributed_optimizer"
    layout_fixed = bool(old.get(distributed) and new.get(distributed))
    refused, allowed = [], []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before == after:
            continue
        note = old_notes.get(key) or new_notes.get(key, "")
        line = f"{key}{note}: {before!r} in the checkpoint, {after!r} now"
        reason = _refused(key, layout_fixed, model_only)
        if reason is None:
            allowed.append(line)
        else:
            refused.append(line + reason)
    return refused, allowed


def check_resumed_config(path: str, cfg: TrainConfig, *, export_only: bool = False) -> None:
    """Refuse settings that change the results since checkpoint `path` was written; log the rest.
    An export only needs the model (and the distributed optimizer's layout) to match."""
    saved = _load_saved_config(path)
    if saved is None:
        return
    refused, allowed = config_changes(saved, to_dict(cfg), model_only=export_only)
    flag = "--export-only" if export_only else "--resume"
    for line in allowed:
        logger.warning("%s: changed since %s was saved: %s", flag, path, line)
    if refused:
        raise ResumeError(f"{flag}: the config differs from {os.path.join(path, 'config.yaml')} in "
                          f"settings that change the results: {'; '.join(refused)}. Resume with the "
                          "checkpoint's values, or start a new run (another run.output_dir, or --overwrite)")


# ------------------------------------------------------------------ load


def _load_rng_file(rng_file: str) -> dict:
    try:  # only tensors, numbers, strings and containers: a checkpoint file must not run code
        return torch.load(rng_file, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{rng_file}: not a plain RNG state file (tensors, numbers, containers); "
                         f"refusing to unpickle it: {err}") from None


def load_checkpoint(path: str, engine) -> TrainerState:
    """Restore engine (model, optimizer, schedule), RNG states; return the trainer state."""
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ValueError(f"checkpoint {path!r}: no trainer_state.json (not a complete checkpoint)")
    engine.load_checkpoint(os.path.join(path, "engine"))
    rng_file = os.path.join(path, "rng", f"rank_{global_rank():05d}.pt")
    if os.path.isfile(rng_file):
        restore_rng_states(_load_rng_file(rng_file))
    else:
        logger.warning("checkpoint %s has no RNG state for rank %d (different world size?)", path, global_rank())
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = TrainerState(**json.load(f))
    logger.info("resumed from %s (step %d, weight version %d)", path, state.step, state.weight_version)
    return state


def rollout_version_on_resume(state: TrainerState, every_steps: int) -> int:
    """The version under which the restored student enters the (freshly started) rollout engine.

    The uninterrupted run's engine holds the student of its last sync, step (step // every_steps)
    * every_steps. Periodic checkpoints fall on sync steps only (the config check makes
    `checkpoint.save_every` a multiple of `weight_sync.every_steps`), so there the restored student
    *is* those weights and keeps its version: the resumed run equals the uninterrupted one. We chose
    this over storing the last-synced weights in the checkpoint, which would cost a second copy of
    the model. Only an end-of-run checkpoint (when run.steps is not a multiple of every_steps) falls
    between syncs: the engine's older weights are not in it, so the restored, newer weights enter as
    a new version, as if the run had synced after its last step, and the log says so.
    """
    if state.step % every_steps == 0:
        return state.weight_version
    logger.warning("checkpoint of step %d falls between weight syncs (every %d steps): the rollout "
                   "engine gets the step-%d weights as version %d, where an uninterrupted run would "
                   "still sample from those of step %d", state.step, every_steps, state.step,
                   state.weight_version + 1, state.step - state.step % every_steps)
    return state.weight_version + 1
