"""Cross-field checks: everything that would fail later is rejected here, before anything starts.

Each check raises `ConfigError` whose message begins with the offending key path and says what
was expected. Model shapes (heads, layers, vocabulary) come from the checkpoint's `config.json`;
for hub names that are not local directories a small table of known shapes is used, so that the
real-scale recipes validate on a laptop.
"""
from __future__ import annotations

import dataclasses
import json
import os

from opkd_mcore.config.loader import ConfigError
from opkd_mcore.platform.device import DEVICE_TYPES
from opkd_mcore.config.schema import (
    AGGREGATIONS, DIVERGENCES, DTYPES, KL_ESTIMATORS, LOSS_FORMS, LOSS_IMPLS, MASSES,
    ROUTINGS, SCHEDULES, SUPPORTS, TASKS, TEACHER_BACKENDS, TOPK_BACKENDS, TrainConfig,
)

# Shapes of public checkpoints the recipes name (from their config.json), used when the path is a
# hub id rather than a local directory. Fields: heads, kv_heads, layers, vocab.
KNOWN_MODEL_SHAPES = {
    "Qwen/Qwen3-0.6B": dict(heads=16, kv_heads=8, layers=28, vocab=151936),
    "Qwen/Qwen3-1.7B": dict(heads=16, kv_heads=8, layers=28, vocab=151936),
    "Qwen/Qwen3-4B": dict(heads=32, kv_heads=8, layers=36, vocab=151936),
    "Qwen/Qwen3-8B": dict(heads=32, kv_heads=8, layers=36, vocab=151936),
    "Qwen/Qwen3-14B": dict(heads=40, kv_heads=8, layers=40, vocab=151936),
    "Qwen/Qwen3-32B": dict(heads=64, kv_heads=8, layers=64, vocab=151936),
}
DEVICES = (None, *DEVICE_TYPES)
TRANSPORTS = ("group", "colocated_ipc")  # keys of weight_sync.transport.TRANSPORTS


def _choice(path: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{path}: expected one of {list(options)}, got {value!r}")


def _positive(path: str, value, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: expected {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def model_shape(path_key: str, model: str, check_files: bool) -> dict | None:
    """heads / kv_heads / layers / vocab of a checkpoint, or None when unknown and not checked."""
    cfg_file = os.path.join(model, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            hf = json.load(f)
        hf = hf.get("text_config", hf)
        heads = hf["num_attention_heads"]
        return dict(heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
                    layers=hf["num_hidden_layers"], vocab=hf["vocab_size"])
    if model in KNOWN_MODEL_SHAPES:
        return KNOWN_MODEL_SHAPES[model]
    if check_files:
        raise ConfigError(f"{path_key}: no HF checkpoint at {model!r} (expected a directory with "
                          f"config.json, or one of {sorted(KNOWN_MODEL_SHAPES)})")
    return None


def launch_world_size(cfg: TrainConfig) -> int:
    """Ranks of the run: `parallel.world_size` if set, else the launcher's WORLD_SIZE, else 1."""
    return cfg.parallel.world_size or int(os.environ.get("WORLD_SIZE", "1"))


def _check_parallel(cfg: TrainConfig, shape: dict | None) -> None:
    par = cfg.parallel
    for name in ("tp", "pp", "cp", "ep", "micro_batch_size", "global_batch_size"):
        _positive(f"parallel.{name}", getattr(par, name))
    if par.vpp is not None:
        _positive("parallel.vpp", par.vpp)
        if par.pp == 1:
            raise ConfigError(f"parallel.vpp: virtual pipeline needs parallel.pp > 1, got vpp={par.vpp} "
                              "with pp=1 (set vpp: null)")
    if shape is not None:
        for key in ("heads", "kv_heads"):
            if shape[key] % par.tp:
                raise ConfigError(f"parallel.tp: {par.tp} does not divide the model's {shape[key]} "
                                  f"{'attention' if key == 'heads' else 'key/value'} heads "
                                  f"({cfg.model.student})")
        chunks = par.pp * (par.vpp or 1)
        if shape["layers"] % chunks:
            raise ConfigError(f"parallel.pp: pp*vpp = {chunks} does not divide the model's "
                              f"{shape['layers']} layers ({cfg.model.student})")
    world = launch_world_size(cfg)
    model_parallel = par.tp * par.pp * par.cp
    if world % model_parallel:
        raise ConfigError(f"parallel.tp: tp*pp*cp = {model_parallel} does not divide the world size "
                          f"{world}")
    dp = world // model_parallel
    if par.global_batch_size % (par.micro_batch_size * dp):
        raise ConfigError(f"parallel.global_batch_size: {par.global_batch_size} is not divisible by "
                          f"micro_batch_size*dp = {par.micro_batch_size}*{dp}")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n
    if par.global_batch_size != samples:
        raise ConfigError(f"parallel.global_batch_size: {par.global_batch_size} must equal the "
                          f"samples per step rollout.prompts_per_step*rollout.n = {samples}")


def _check_teachers(cfg: TrainConfig, student_shape: dict | None, check_files: bool) -> None:
    tcfg = cfg.teacher
    _choice("teacher.routing", tcfg.routing, ROUTINGS)
    if not tcfg.teachers:
        raise ConfigError("teacher.teachers: expected at least one teacher")
    defaults, sources = 0, {}
    for i, t in enumerate(tcfg.teachers):
        path = f"teacher.teachers.{i}"
        _choice(f"{path}.backend", t.backend, TEACHER_BACKENDS)
        _positive(f"{path}.top_k", t.top_k)
        if t.replica_urls and t.backend != "remote":
            raise ConfigError(f"{path}.replica_urls: replicas are servers; only a remote teacher has them")
        if t.backend == "remote" and not t.url:
            raise ConfigError(f"{path}.url: a remote teacher needs the server's base URL")
        if t.backend != "remote":
            if not t.model:
                raise ConfigError(f"{path}.model: the {t.backend} teacher needs an HF checkpoint")
            shape = model_shape(f"{path}.model", t.model, check_files)
            if shape and student_shape and shape["vocab"] != student_shape["vocab"]:
                raise ConfigError(f"{path}.model: vocabulary {shape['vocab']} differs from the "
                                  f"student's {student_shape['vocab']} (same tokenizer needed)")
            if t.backend == "megatron" and shape and (shape["heads"] % cfg.parallel.tp
                                                      or shape["kv_heads"] % cfg.parallel.tp):
                raise ConfigError(f"parallel.tp: {cfg.parallel.tp} does not divide the heads of the "
                                  f"megatron teacher {path}.model ({t.model})")
        defaults += not t.data_sources
        for src in t.data_sources:
            if src in sources:
                raise ConfigError(f"{path}.data_sources: {src!r} is already routed to "
                                  f"teacher.teachers.{sources[src]}")
            sources[src] = i
    if defaults > 1:
        raise ConfigError("teacher.teachers: more than one teacher without data_sources "
                          "(only one default teacher is allowed)")
    kinds = {t.backend in TOPK_BACKENDS for t in tcfg.teachers}
    if len(kinds) > 1:
        raise ConfigError("teacher.teachers: dense (megatron) and top-k (vllm/remote) teachers cannot "
                          "be mixed under one loss")


def _check_loss(cfg: TrainConfig) -> None:
    loss = cfg.loss
    _choice("loss.form", loss.form, LOSS_FORMS)
    _choice("loss.divergence", loss.divergence, DIVERGENCES)
    _choice("loss.support", loss.support, SUPPORTS)
    _choice("loss.mass", loss.mass, MASSES)
    _choice("loss.impl", loss.impl, LOSS_IMPLS)
    _choice("loss.aggregation", loss.aggregation, AGGREGATIONS)
    _choice("loss.kl_estimator", loss.kl_estimator, KL_ESTIMATORS)
    if not 0.0 <= loss.beta <= 1.0:
        raise ConfigError(f"loss.beta: expected a value in [0, 1], got {loss.beta}")
    _positive("loss.temperature", loss.temperature)
    _positive("loss.coverage_coef", loss.coverage_coef, allow_zero=True)
    _positive("loss.clip_eps", loss.clip_eps)
    if loss.mass == "raw" and loss.divergence != "forward_kl":
        raise ConfigError(f"loss.mass: 'raw' is defined for forward_kl only, got divergence "
                          f"{loss.divergence!r} (use renorm or tail)")
    topk = cfg.teacher.teachers and cfg.teacher.teachers[0].backend in TOPK_BACKENDS
    if topk:
        if loss.support == "union":
            raise ConfigError("loss.support: 'union' needs teacher values on the student's top-k ids, "
                              "so it needs a dense (megatron) teacher, not a top-k teacher")
        if loss.support is None and loss.form == "logit":
            raise ConfigError("loss.support: a top-k teacher has no full-vocabulary distribution; "
                              "set support: teacher")
        if loss.temperature != 1.0:
            raise ConfigError(f"loss.temperature: {loss.temperature} would not rescale a top-k "
                              "teacher's logprobs; only 1.0 is honoured with a top-k teacher")
        if loss.k is not None and loss.k > min(t.top_k for t in cfg.teacher.teachers):
            raise ConfigError(f"loss.k: {loss.k} exceeds the teachers' top_k")
    elif loss.support is not None and loss.k is None:
        raise ConfigError(f"loss.k: support={loss.support!r} with a dense teacher needs k (top-k size)")
    if loss.k is not None:
        _positive("loss.k", loss.k)
    if loss.task_reward_coef and loss.form != "policy_gradient":
        raise ConfigError("loss.task_reward_coef: task rewards enter through the policy-gradient form; "
                          "set loss.form: policy_gradient")


def _check_optim(cfg: TrainConfig) -> None:
    """The engine's own checks, with the decay length defaulting to run.steps as the trainer does."""
    optim = dataclasses.replace(cfg.optim)
    if optim.lr_decay_style != "constant" and optim.lr_decay_steps is None:
        optim.lr_decay_steps = cfg.run.steps
    try:
        optim.validate()
    except ValueError as err:
        raise ConfigError(str(err).replace("OptimConfig.", "optim.", 1)) from None


def _check_rest(cfg: TrainConfig, check_files: bool) -> None:
    _choice("model.params_dtype", cfg.model.params_dtype, DTYPES)
    ro = cfg.rollout
    for name in ("prompts_per_step", "n", "max_new_tokens", "max_model_len"):
        _positive(f"rollout.{name}", getattr(ro, name))
    _positive("rollout.temperature", ro.temperature, allow_zero=True)
    if not 0.0 < ro.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {ro.top_p}")
    if ro.max_new_tokens >= ro.max_model_len:
        raise ConfigError(f"rollout.max_new_tokens: {ro.max_new_tokens} leaves no room for the prompt "
                          f"in rollout.max_model_len = {ro.max_model_len}")
    _check_optim(cfg)
    ws = cfg.weight_sync
    _positive("weight_sync.bucket_mb", ws.bucket_mb)
    _positive("weight_sync.every_steps", ws.every_steps)
    _choice("weight_sync.transport", ws.transport, TRANSPORTS)
    data = cfg.data
    if data.train_path is None:
        if data.task is None:
            raise ConfigError("data.train_path: set a prompt file, or data.task for a synthetic task")
        _choice("data.task", data.task, TASKS)
        _positive("data.task_digits", data.task_digits)
    for key in ("train_path", "eval_path"):
        value = getattr(data, key)
        if value is None:
            continue
        if not value.endswith((".jsonl", ".json", ".parquet")):
            raise ConfigError(f"data.{key}: expected a .jsonl or .parquet file, got {value!r}")
        if check_files and not os.path.isfile(value):
            raise ConfigError(f"data.{key}: file {value!r} does not exist")
    run = cfg.run
    _positive("run.steps", run.steps)
    _choice("run.schedule", run.schedule, SCHEDULES)
    _choice("run.device", run.device, DEVICES)
    if not run.output_dir:
        raise ConfigError("run.output_dir: expected a directory path")
    _positive("checkpoint.save_every", cfg.checkpoint.save_every, allow_zero=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    _positive("logging.console_every", cfg.logging.console_every, allow_zero=True)


def validate_config(cfg: TrainConfig, *, check_files: bool = True) -> TrainConfig:
    """Raise `ConfigError` (a ValueError) naming the key path of the first impossible setting."""
    if not cfg.model.student:
        raise ConfigError("model.student: expected the student's HF checkpoint directory or hub id")
    student_shape = model_shape("model.student", cfg.model.student, check_files)
    _check_rest(cfg, check_files)
    _check_teachers(cfg, student_shape, check_files)
    _check_loss(cfg)
    _check_parallel(cfg, student_shape)
    return cfg
