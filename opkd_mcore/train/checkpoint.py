"""Checkpoints of a distillation run, `--resume` and `--overwrite`.

    <output_dir>/checkpoints/step_000012/
        engine/               student model + optimizer + LR schedule (Megatron dist checkpoint)
        teacher_ema/          a self teacher's moving average of the student (weights: ema), if any
        trainer_state.json    step, weight version, data-sampler position
        rng/rank_00000.pt     every RNG state of each rank (platform.rng_state)
        config.yaml           the resolved config the checkpoint was written with
    <output_dir>/checkpoints/latest   name of the newest complete checkpoint

Every file is fsynced before `latest` names its checkpoint, and `latest` is replaced atomically
(after every rank has finished), so a run killed mid-save, or a machine losing power, resumes from
the previous complete checkpoint.

Before anything starts, `check_run_dir` decides what the output directory means, modifying nothing:
a fresh run refuses one that holds an earlier run's output (`RUN_ARTIFACTS`) unless `--overwrite`,
`--resume` needs a complete checkpoint (the newest one, when `latest` names a missing or incomplete
one), and a resumed config may change only settings that leave the results unchanged.
`prepare_run_dir` checks, then acts: `--overwrite` removes exactly `RUN_ARTIFACTS`, and a dangling
`latest` is repaired. Nothing else in this package deletes anything in the output directory.
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
from opkd_mcore.platform.durable import fsync_path, fsync_tree
from opkd_mcore.platform.rng_state import capture_rng_states, restore_rng_states
from opkd_mcore.train.metrics import METRICS_FILE, PROFILE_DIR, TENSORBOARD_DIR
from opkd_mcore.train.samples_log import SAMPLES_FILE

logger = logging.getLogger(__name__)

LATEST = "latest"
STEP_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
ENGINE_DIR = "engine"
TEACHER_STATE_DIR = "teacher_ema"  # the weights of a teacher that follows the student (weights: ema)
EXPORT_DIR = "student_hf"  # the final student as an HF checkpoint
# Everything a run writes into its output directory (fnmatch patterns), and so everything
# `--overwrite` removes: the export's staging directories and the JSONL files' truncation copies
# that a killed run leaves behind are its own too. A fresh run refuses a directory holding any.
# Not `SKIPPED_FILE` (skipped_prompts.jsonl): every start rewrites it whole, so an earlier run's copy
# is never kept, and rank 0 writes it while reading the data, before the ranks meet in
# `init_distributed` (the data is checked before any engine starts), when a slower rank of the same
# run may still be checking the directory and must not take it for an earlier run's output.
RUN_ARTIFACTS = (
    "checkpoints", METRICS_FILE, f"{METRICS_FILE}.tmp", SAMPLES_FILE, f"{SAMPLES_FILE}.tmp",
    EXPORT_DIR, f".{EXPORT_DIR}.tmp-*", f".{EXPORT_DIR}.old-*", "config.yaml", TENSORBOARD_DIR,
    PROFILE_DIR,
)


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


def _point_latest(root: str, name: str) -> None:
    """Make `root/latest` name `name`: write a temporary file, fsync, rename, fsync the directory."""
    tmp = os.path.join(root, LATEST + ".tmp")
    _write_text(tmp, name)
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_path(root)


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
    engine.save_checkpoint(os.path.join(path, ENGINE_DIR))
    teacher = _stateful_teacher(engine)
    if teacher is not None:
        teacher.save_state(os.path.join(path, TEACHER_STATE_DIR))
    _save_torch(capture_rng_states(), os.path.join(path, "rng", f"rank_{global_rank():05d}.pt"))
    _barrier()
    if global_rank() == 0:
        # trainer_state.json last, once every rank's part is durable: a directory holding it is a
        # complete checkpoint, which is what resume falls back to when `latest` is dangling
        fsync_tree(os.path.join(path, ENGINE_DIR))
        if teacher is not None:
            fsync_tree(os.path.join(path, TEACHER_STATE_DIR))
        fsync_path(os.path.join(path, "rng"))
        _write_text(os.path.join(path, "config.yaml"), config_yaml)
        _write_text(os.path.join(path, STATE_FILE), json.dumps(asdict(state), indent=2))
        fsync_path(path)
        _point_latest(root, name)
        _prune(root, keep_last, name)
    _barrier()
    logger.info("saved checkpoint %s", path)
    return path


def _stateful_teacher(engine):
    """The engine's in-step teacher when its weights are part of the run's state (an EMA), else None."""
    teacher = getattr(engine, "teacher", None)
    return teacher if getattr(teacher, "stateful", False) else None


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


def _is_complete(path: str) -> bool:
    """A checkpoint directory whose engine part and trainer state were both written (`save_checkpoint`
    writes the state last, once every rank's part is durable)."""
    if not os.path.isdir(os.path.join(path, ENGINE_DIR)):
        return False
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return isinstance(json.load(f), dict)
    except (OSError, ValueError):  # missing, or torn by a kill mid-write
        return False


def _pointed(output_dir: str) -> str | None:
    """The checkpoint `latest` names (complete or not), or None without a pointer."""
    try:
        with open(os.path.join(checkpoint_root(output_dir), LATEST)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return os.path.join(checkpoint_root(output_dir), name) if name else None


def latest_checkpoint(output_dir: str) -> str | None:
    """Path of the checkpoint to continue from: the one `latest` names when it is complete, else the
    newest complete one (by step), else None. Reads only; `prepare_run_dir` repairs the pointer."""
    pointed = _pointed(output_dir)
    if pointed is not None and _is_complete(pointed):
        return pointed
    root = checkpoint_root(output_dir)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    complete = [(step, name) for name in names
                if (step := _step_of(name)) is not None and _is_complete(os.path.join(root, name))]
    return os.path.join(root, max(complete)[1]) if complete else None


def require_checkpoint(output_dir: str, flag: str = "--resume") -> str:
    """The checkpoint `flag` continues from; `ResumeError` naming the directory when there is none."""
    path = latest_checkpoint(output_dir)
    if path is None:
        raise ResumeError(f"{flag}: no complete checkpoint under {checkpoint_root(output_dir)} (none "
                          f"holds both {STATE_FILE} and {ENGINE_DIR}/); start afresh without {flag} "
                          "(add --overwrite if the directory holds an earlier run's output), or choose "
                          "another run.output_dir")
    return path


def find_artifacts(output_dir: str, patterns: tuple[str, ...] = RUN_ARTIFACTS) -> list[str]:
    """Names in `output_dir` matching `patterns`, sorted; an empty directory does not count."""
    try:
        names = sorted(os.listdir(output_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if not any(fnmatch(name, pattern) for pattern in patterns):
            continue
        path = os.path.join(output_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
                continue
        except FileNotFoundError:  # another rank is removing it for --overwrite right now
            continue
        found.append(name)
    return found


def remove_artifacts(output_dir: str, patterns: tuple[str, ...] = RUN_ARTIFACTS) -> list[str]:
    """Remove the entries of `output_dir` matching `patterns` (and nothing else), logging each."""
    removed = []
    for name in sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []:
        if not any(fnmatch(name, pattern) for pattern in patterns):
            continue
        path = os.path.join(output_dir, name)
        logger.warning("--overwrite: removing %s", path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(name)
    return removed


def _refuse_output_file(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ResumeError(f"run.output_dir: {out!r} is an existing file; expected a directory (or a "
                          "path that does not exist yet)")


def _warn_if_fallen_back(out: str, path: str, flag: str) -> None:
    pointed, marker = _pointed(out), os.path.join(checkpoint_root(out), LATEST)
    if pointed == path:
        return
    what = f"names {pointed}, which is missing or incomplete" if pointed else "is missing"
    logger.warning("%s: %s %s; continuing from %s, the newest complete checkpoint", flag, marker, what, path)


def check_run_dir(cfg: TrainConfig, *, resume: bool, export_only: bool = False,
                  overwrite: bool = False) -> str | None:
    """What the output directory means for this command line; modifies nothing.

    --resume / --export-only: the checkpoint to continue from (the newest complete one when `latest`
    is dangling, with a warning), its saved config compared to `cfg`. A fresh run: None; a directory
    holding an earlier run's output is refused unless `overwrite`. `ResumeError` for what the
    directory cannot serve.
    """
    out = cfg.run.output_dir
    _refuse_output_file(out)
    if resume or export_only:
        flag = "--export-only" if export_only else "--resume"
        if overwrite:
            raise ResumeError(f"--overwrite: cannot be combined with {flag}, which continues the run in "
                              f"{out}; drop one of them")
        path = require_checkpoint(out, flag)
        _warn_if_fallen_back(out, path, flag)
        check_resumed_config(path, cfg, export_only=export_only)
        return path
    found = find_artifacts(out)
    if found and not overwrite:
        resume_hint = "continue it with --resume, " if latest_checkpoint(out) else ""
        raise ResumeError(f"run.output_dir: {out} holds an earlier run's output ({', '.join(found)}); "
                          f"{resume_hint}replace that output with --overwrite (nothing else in the "
                          "directory is touched), or choose another run.output_dir")
    return None


def prepare_run_dir(cfg: TrainConfig, *, resume: bool, export_only: bool = False,
                    overwrite: bool = False) -> str | None:
    """`check_run_dir`, then on rank 0: `overwrite` removes the earlier run's `RUN_ARTIFACTS`, and a
    dangling `latest` is pointed at the checkpoint resumed from. Nothing changes when it raises."""
    path = check_run_dir(cfg, resume=resume, export_only=export_only, overwrite=overwrite)
    if global_rank() != 0:  # every rank sees the same directory; one changes it
        return path
    out = cfg.run.output_dir
    if path is None and overwrite:
        remove_artifacts(out)
    elif path is not None and _pointed(out) != path:
        _point_latest(checkpoint_root(out), os.path.basename(path))
        logger.warning("%s now names %s", os.path.join(checkpoint_root(out), LATEST), path)
    return path


# ------------------------------------------------------------------ resumed config vs saved config

# A resumed run may change these: they say where and how the work runs, or how it is reported,
# never what is computed. `run.steps` is here, but when the LR decay length defaults to it the
# change shows up as `optim.lr_decay_steps` (refused). TP/PP/VPP/CP/EP are here because Megatron
# dist checkpoints load into any layout (results equal up to float rounding), except with the
# distributed optimizer, whose checkpoint needs the same layout (`LAYOUT_KEYS`).
RESUMABLE_KEYS = (
    "run.steps", "run.output_dir", "run.device",
    "logging.*", "checkpoint.*",
    "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.etp",
    "parallel.world_size",
    # memory levers: recompute gives the same numbers, sequence parallelism reorders TP's reductions only
    "parallel.recompute", "parallel.sequence_parallel",
    "teacher.teachers.*.url", "teacher.teachers.*.replica_urls", "teacher.teachers.*.offload",
    "weight_sync.host", "weight_sync.bucket_mb", "weight_sync.transport", "weight_sync.tp_export",
    "weight_sync.high_priority_stream",
    "rollout.gpu_memory_utilization", "rollout.enforce_eager",
    "loss.impl",  # reference or fused kernels: the same loss
    "optim.overlap_grad_reduce", "optim.overlap_param_gather",  # when DP collectives run, not what they sum
    # who runs the stages and where (the schedule, a result key, decides what overlaps); a torchrun
    # `sync` checkpoint and a Ray `sync` one hold the same state (nothing in flight)
    "controller.*",
)
# These change the numbers a run produces (and an unlisted key is treated the same way): the
# model, batch shapes, objective, optimizer (including the checkpoint layout of the distributed
# optimizer), data and its order, rollout sampling, teachers and what they return, sync cadence.
RESULT_KEYS = (
    "model.*", "parallel.micro_batch_size", "parallel.max_tokens_per_micro_batch",
    "parallel.global_batch_size", "loss.*", "optim.*", "data.*", "rollout.*", "teacher.*",
    "weight_sync.every_steps", "run.seed", "run.schedule",
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
    # earlier versions of the trainer saved the command line's --overwrite as `run.overwrite`: the
    # trainer wrote it, not the user, and it says nothing about the results
    if isinstance(tree, dict) and isinstance(tree.get("run"), dict):
        tree["run"].pop("overwrite", None)
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
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise ValueError(f"checkpoint {path!r}: no {STATE_FILE} (not a complete checkpoint)")
    engine.load_checkpoint(os.path.join(path, ENGINE_DIR))
    teacher = _stateful_teacher(engine)
    if teacher is not None:
        state_dir = os.path.join(path, TEACHER_STATE_DIR)
        if not os.path.isdir(state_dir):
            raise ValueError(f"checkpoint {path!r}: no {TEACHER_STATE_DIR}/ holding the weights of the "
                             f"teacher {teacher.name}; it was written by a run without that teacher")
        teacher.load_state(state_dir)
    rng_file = os.path.join(path, "rng", f"rank_{global_rank():05d}.pt")
    if os.path.isfile(rng_file):
        restore_rng_states(_load_rng_file(rng_file))
    else:
        logger.warning("checkpoint %s has no RNG state for rank %d (different world size?)",
                       path, global_rank())
    with open(os.path.join(path, STATE_FILE)) as f:
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
