"""Cross-field checks: everything that would fail later is rejected here, before anything starts.

Each check raises `ConfigError` whose message begins with the offending key path and says what
was expected. The primitives are in `checks.py`; what depends on the models a run names (shapes,
vocabularies, the parallel layout) in `model_checks.py`; this file checks the sections.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from opkd_mcore.config.checks import (
    check_finite,
    check_url,
    choice,
    format_fields,
    in_range,
    non_empty,
    positive,
    seed_in_range,
)
from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.loss_rules import (
    cross_tokenizer_mode,
    fused_lm_head_mode,
    lm_head_blocker,
    runs_in_step,
    teacher_kind,
    teacher_output,
)
from opkd_mcore.config.model_checks import (
    TokenizerInfo,
    check_context,
    check_parallel,
    check_student_vocab,
    check_top_k,
    check_vocab,
    load_tokenizer_info,
    model_shape,
)
from opkd_mcore.config.placement_rules import check_colocated
from opkd_mcore.config.schema import (
    AGGREGATIONS,
    BUILTIN_REWARDS,
    CHAT_TEMPLATES,
    CONTROLLERS,
    DENSE_BACKENDS,
    DIVERGENCES,
    DTYPES,
    FUSED_LM_HEAD_MODES,
    HIDDEN_BACKENDS,
    IN_FLIGHT_UPDATES,
    KL_ESTIMATORS,
    LM_HEAD_ENGINES,
    LOSS_FORMS,
    LOSS_IMPLS,
    MASSES,
    MISSING_TEACHER_PROMPT_POLICIES,
    MOE_EXPERTS,
    OVERLAPPED_SCHEDULES,
    OVERLONG_POLICIES,
    PLACEMENTS,
    ROUTINGS,
    SAMPLE_SEEDS,
    SCHEDULES,
    SELF_WEIGHTS,
    STALE_POLICIES,
    SUPPORTS,
    TASKS,
    TEACHER_BACKENDS,
    TEACHER_OUTPUTS,
    TEACHER_SCORINGS,
    TeacherEndpoint,
    TrainConfig,
)
from opkd_mcore.config.tokenizer_rules import check_cross_tokenizer
from opkd_mcore.platform.device import DEVICE_TYPES

logger = logging.getLogger(__name__)

DEVICES = (None, *DEVICE_TYPES)
TRANSPORTS = ("auto", "group", "colocated_ipc")  # "auto" + keys of weight_sync.transport.TRANSPORTS
TP_EXPORTS = ("auto", "gather", "peer")  # weight_sync.peer_export.TP_EXPORTS


def _check_endpoint(path: str, t: TeacherEndpoint) -> None:
    """One teacher's own fields, without reading its checkpoint."""
    non_empty(f"{path}.name", t.name)
    choice(f"{path}.backend", t.backend, TEACHER_BACKENDS)
    choice(f"{path}.output", t.output, TEACHER_OUTPUTS)
    choice(f"{path}.scoring", t.scoring, TEACHER_SCORINGS)
    if t.scoring != "auto" and (t.backend not in ("vllm", "remote") or teacher_output(t) != "topk"):
        raise ConfigError(f"{path}.scoring: {t.scoring!r} chooses how a vllm or remote teacher computes "
                          f"its top-k rows; it does not apply to this teacher (backend {t.backend!r}, output "
                          f"{teacher_output(t)!r}): set scoring: auto")
    if t.output == "dense" and t.backend not in DENSE_BACKENDS:
        raise ConfigError(f"{path}.output: 'dense' needs full-vocabulary logits, which only the "
                          f"{' and '.join(DENSE_BACKENDS)} backends compute; got backend "
                          f"{t.backend!r} (use topk)")
    if t.output == "hidden" and t.backend not in HIDDEN_BACKENDS:
        raise ConfigError(f"{path}.output: 'hidden' (final-norm hidden states) is served by the "
                          f"{' and '.join(HIDDEN_BACKENDS)} backends; got backend {t.backend!r}")
    choice(f"{path}.weights", t.weights, SELF_WEIGHTS)
    if t.weights != "current" and t.backend != "self":
        raise ConfigError(f"{path}.weights: only a self teacher chooses its weights; got {t.weights!r} with "
                          f"backend {t.backend!r} (leave weights: current)")
    if t.offload and t.backend != "megatron" and not (t.backend == "self" and t.weights != "current"):
        raise ConfigError(f"{path}.offload: only a megatron teacher's weights, or a self teacher's copy "
                          f"(weights: initial | ema), move to host memory between steps; got backend "
                          f"{t.backend!r}, weights {t.weights!r} (set offload: false)")
    choice(f"{path}.dtype", t.dtype, ("auto", *DTYPES))
    if t.dtype != "auto" and t.backend not in ("vllm", "hf"):
        raise ConfigError(f"{path}.dtype: set for the vllm and hf backends only (a megatron teacher "
                          "computes in model.params_dtype, a remote one in its server's dtype); "
                          f"got backend {t.backend!r} (set dtype: auto)")
    positive(f"{path}.top_k", t.top_k)
    for j, source in enumerate(t.data_sources):
        non_empty(f"{path}.data_sources.{j}", source)
    if t.backend == "remote":
        if t.output == "hidden" and not t.model:
            raise ConfigError(f"{path}.model: a remote teacher with output: hidden needs its HF checkpoint "
                              "here too: the trainer applies the teacher's output weight itself")
        check_url(f"{path}.url", t.url)
        for j, url in enumerate(t.replica_urls):
            check_url(f"{path}.replica_urls.{j}", url)
        return
    if t.url is not None or t.replica_urls:
        key = "url" if t.url is not None else "replica_urls"
        raise ConfigError(f"{path}.{key}: only a remote teacher is a server reached by URL; got "
                          f"backend {t.backend!r}")
    if t.backend == "self":
        _check_self_endpoint(path, t)
    elif not t.model:
        raise ConfigError(f"{path}.model: the {t.backend} teacher needs an HF checkpoint")


def _check_self_endpoint(path: str, t: TeacherEndpoint) -> None:
    """The student as its own teacher: no checkpoint of its own; the weights it scores with."""
    if t.model:
        raise ConfigError(f"{path}.model: a self teacher is the student (model.student), so it takes no "
                          f"model; leave it empty, got {t.model!r}")
    if t.weights == "ema" and not 0 < t.ema_decay < 1:
        raise ConfigError(f"{path}.ema_decay: expected a value in (0, 1) for weights: ema, "
                          f"got {t.ema_decay!r}")
    if teacher_output(t) == "topk" and t.weights != "current":
        raise ConfigError(f"{path}.weights: output: topk scores with the rollout engine, which holds the "
                          f"current weights only; got {t.weights!r} (use output: dense for initial or ema)")


def _check_teacher_model(cfg: TrainConfig, path: str, t: TeacherEndpoint, student_shape: dict | None,
                         tokenizers: dict, check_files: bool) -> None:
    """The checkpoint of an in-process teacher against the student's vocabulary and the layout."""
    shape = model_shape(f"{path}.model", t.model, check_files)
    if shape is None:
        return
    check_context(f"{path}.model", t.model, shape, cfg.rollout.max_model_len)
    if teacher_output(t) == "topk":
        check_top_k(f"{path}.top_k", t.top_k, t.model, shape)
    tp = cfg.parallel.tp
    if t.backend == "megatron" and (shape["heads"] % tp or shape["kv_heads"] % tp):
        raise ConfigError(f"parallel.tp: {tp} does not divide the heads of the megatron teacher "
                          f"{path}.model ({t.model})")
    # an MoE megatron teacher splits its experts over the student's EP groups
    if t.backend == "megatron" and shape.get("experts") and shape["experts"] % cfg.parallel.ep:
        raise ConfigError(f"parallel.ep: {cfg.parallel.ep} does not divide the {shape['experts']} experts "
                          f"of the megatron teacher {path}.model ({t.model})")
    if student_shape is None:
        return
    student_tok = load_tokenizer_info("model.student", cfg.model.student, tokenizers)
    teacher_tok = load_tokenizer_info(f"{path}.model", t.model, tokenizers)
    # a dense teacher may have more rows (padding): the trainer keeps the student's ids only
    check_vocab(f"{path}.model", shape["vocab"], teacher_tok, student_shape["vocab"], student_tok,
                cross_tokenizer_mode(cfg.loss.cross_tokenizer))


def _check_teachers(cfg: TrainConfig, student_shape: dict | None, tokenizers: dict,
                    check_files: bool) -> None:
    tcfg = cfg.teacher
    choice("teacher.routing", tcfg.routing, ROUTINGS)
    if not tcfg.teachers:
        raise ConfigError("teacher.teachers: expected at least one teacher")
    defaults, sources, names = 0, {}, {}
    for i, t in enumerate(tcfg.teachers):
        path = f"teacher.teachers.{i}"
        _check_endpoint(path, t)
        if t.name in names:  # the router keys teachers by name: a repeat would replace one
            raise ConfigError(f"{path}.name: {t.name!r} is already the name of "
                              f"teacher.teachers.{names[t.name]} (names must be unique)")
        names[t.name] = i
        if t.backend == "self":  # the student's checkpoint, checked as the student's
            if teacher_output(t) == "topk" and student_shape is not None:
                check_top_k(f"{path}.top_k", t.top_k, cfg.model.student, student_shape)
        elif t.backend != "remote":
            _check_teacher_model(cfg, path, t, student_shape, tokenizers, check_files)
        defaults += not t.data_sources
        for src in t.data_sources:
            if src in sources:
                raise ConfigError(f"{path}.data_sources: {src!r} is already routed to "
                                  f"teacher.teachers.{sources[src]}")
            sources[src] = i
    if defaults > 1:
        raise ConfigError("teacher.teachers: more than one teacher without data_sources "
                          "(only one default teacher is allowed)")
    if len({teacher_output(t) for t in tcfg.teachers}) > 1:
        raise ConfigError("teacher.teachers: dense-output teachers (megatron, hf with output: dense) "
                          "and top-k teachers cannot be mixed under one loss")
    _check_in_step_teacher(cfg)


def _check_in_step_teacher(cfg: TrainConfig) -> None:
    """A megatron teacher, or a self teacher with dense output, runs inside the student's step, on every
    micro-batch: it is the run's only teacher, it hands the loss its dense logits, and nothing needs its
    scores before the step. A self teacher with top-k output scores with the rollout engine of the
    torchrun job, right after it generated, so the engine must hold the student's current weights."""
    _check_self_topk(cfg)
    in_step = [i for i, t in enumerate(cfg.teacher.teachers) if runs_in_step(t)]
    if not in_step:
        return
    path, t = f"teacher.teachers.{in_step[0]}", cfg.teacher.teachers[in_step[0]]
    kind = "a megatron teacher" if t.backend == "megatron" else "a self teacher with dense output"
    if len(cfg.teacher.teachers) > 1:
        raise ConfigError(f"{path}.backend: {kind} scores every micro-batch inside the student's step, so "
                          "it must be the run's only teacher (no routing; a self teacher with output: topk "
                          "can be routed to)")
    if t.output == "topk" and t.backend == "megatron":
        raise ConfigError(f"{path}.output: a megatron teacher hands the loss its dense TP-sharded logits; "
                          "for a top-k objective set loss.support: teacher and loss.k instead")
    if cfg.loss.confidence_alpha:
        raise ConfigError(f"loss.confidence_alpha: teacher-confidence weights need the teacher's scores "
                          f"before the step; {kind} scores inside it (use 0)")


def _check_self_topk(cfg: TrainConfig) -> None:
    for i, t in enumerate(cfg.teacher.teachers):
        if t.backend != "self" or teacher_output(t) != "topk":
            continue
        if cfg.controller.kind != "torchrun":
            raise ConfigError(f"teacher.teachers.{i}.output: a self teacher with output: topk scores with "
                              f"the rollout engine of the torchrun job; under controller.kind: "
                              f"{cfg.controller.kind} use output: dense (the student's forward in its step)")
        if cfg.weight_sync.every_steps != 1:
            raise ConfigError(f"weight_sync.every_steps: a self teacher with output: topk scores with the "
                              f"rollout engine, which holds the student of the last sync; expected 1 (the "
                              f"current weights), got {cfg.weight_sync.every_steps}")


def _check_loss(cfg: TrainConfig, student_shape: dict | None) -> None:
    loss = cfg.loss
    choice("loss.form", loss.form, LOSS_FORMS)
    choice("loss.divergence", loss.divergence, DIVERGENCES)
    choice("loss.support", loss.support, SUPPORTS)
    choice("loss.mass", loss.mass, MASSES)
    choice("loss.impl", loss.impl, LOSS_IMPLS)
    choice("loss.aggregation", loss.aggregation, AGGREGATIONS)
    choice("loss.kl_estimator", loss.kl_estimator, KL_ESTIMATORS)
    in_range("loss.beta", loss.beta, 0, 1)
    positive("loss.temperature", loss.temperature)
    positive("loss.clip_eps", loss.clip_eps)
    for name in ("coverage_coef", "confidence_alpha", "pg_coef", "task_reward_coef", "moe_aux_loss_coef"):
        positive(f"loss.{name}", getattr(loss, name), allow_zero=True)
    if loss.moe_aux_loss_coef and student_shape is not None and not student_shape.get("experts"):
        raise ConfigError(f"loss.moe_aux_loss_coef: {loss.moe_aux_loss_coef} needs an MoE student; "
                          f"{cfg.model.student} has no experts")
    if loss.k is not None:
        positive("loss.k", loss.k)
    if loss.mass == "raw" and loss.divergence != "forward_kl":
        raise ConfigError(f"loss.mass: 'raw' is defined for forward_kl only, got divergence "
                          f"{loss.divergence!r} (use renorm or tail)")
    # teachers are all dense or all top-k (`_check_teachers`): the first one speaks for all
    if teacher_output(cfg.teacher.teachers[0]) == "topk":
        if loss.support == "union":
            raise ConfigError("loss.support: 'union' needs teacher values on the student's top-k ids, "
                              "so it needs a dense teacher (megatron, or hf with output: dense), not "
                              "a top-k teacher")
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
    elif loss.k is not None and student_shape and loss.k > student_shape["vocab"]:
        raise ConfigError(f"loss.k: {loss.k} exceeds the student's vocabulary of "
                          f"{student_shape['vocab']} tokens")
    if loss.task_reward_coef and loss.form != "policy_gradient":
        raise ConfigError("loss.task_reward_coef: task rewards enter through the policy-gradient form; "
                          "set loss.form: policy_gradient")
    _check_fused_lm_head(cfg)
    hidden = [i for i, t in enumerate(cfg.teacher.teachers) if teacher_output(t) == "hidden"]
    if hidden and len(cfg.teacher.teachers) > 1:
        raise ConfigError(f"teacher.teachers.{hidden[0]}.output: a hidden-state teacher must be the run's "
                          "only teacher (the trainer holds one teacher output weight; use replica_urls for "
                          "more servers of it)")
    if loss.confidence_alpha and hidden:
        raise ConfigError("loss.confidence_alpha: teacher-confidence weights need the teacher's logprobs of "
                          "the sampled tokens; a hidden-state teacher sends none (use 0)")


def _check_fused_lm_head(cfg: TrainConfig) -> None:
    """`loss.fused_lm_head: on` must take the run's objective and teacher (`loss_rules.lm_head_blocker`;
    `auto` falls back to off). Whether the device runs the kernels it needs is decided with the loss
    plan at start-up (`opkd_mcore.losses.plan.resolve_loss_plan`)."""
    loss = cfg.loss
    mode = fused_lm_head_mode(loss.fused_lm_head)
    choice("loss.fused_lm_head", mode, FUSED_LM_HEAD_MODES)
    choice("loss.lm_head_engine", loss.lm_head_engine, LM_HEAD_ENGINES)
    if loss.lm_head_chunk_mb is not None:
        positive("loss.lm_head_chunk_mb", loss.lm_head_chunk_mb)
    if mode != "on":
        return
    teachers = cfg.teacher.teachers
    first = next((i for i, t in enumerate(teachers) if teacher_output(t) == "dense"), 0)
    named = f"teacher.teachers.{first} (backend {teachers[first].backend!r})"
    blocker = lm_head_blocker(loss, teacher_kind(teachers), teacher=named)
    if blocker is not None:
        raise ConfigError(blocker.config_message())


def _check_optim(cfg: TrainConfig) -> None:
    """The engine's own checks, with the decay length defaulting to run.steps as the trainer does."""
    optim = dataclasses.replace(cfg.optim)
    defaulted = optim.lr_decay_style != "constant" and optim.lr_decay_steps is None
    if defaulted:
        optim.lr_decay_steps = cfg.run.steps
    try:
        optim.validate()
    except ValueError as err:
        msg = str(err)
        if defaulted and msg.startswith("optim.lr_decay_steps"):
            msg += " (lr_decay_steps defaults to run.steps)"
        raise ConfigError(msg) from None
    if optim.lr_decay_style != "constant" and optim.lr_decay_steps < cfg.run.steps:
        # the schedule ends at min_lr and stays there: the last steps would train at the floor
        raise ConfigError(f"optim.lr_decay_steps: the {optim.lr_decay_style} decay reaches optim.min_lr = "
                          f"{optim.min_lr} after {optim.lr_decay_steps} steps, but run.steps = "
                          f"{cfg.run.steps}: the last {cfg.run.steps - optim.lr_decay_steps} steps would "
                          "train at min_lr; set lr_decay_steps >= run.steps (unset, it defaults to "
                          "run.steps)")


def _check_rollout(cfg: TrainConfig) -> None:
    ro = cfg.rollout
    for name in ("prompts_per_step", "n", "max_new_tokens", "max_model_len"):
        positive(f"rollout.{name}", getattr(ro, name))
    positive("rollout.temperature", ro.temperature, allow_zero=True)
    in_range("rollout.top_p", ro.top_p, 0, 1, low_open=True)
    if not (ro.top_k == -1 or ro.top_k >= 1):
        raise ConfigError(f"rollout.top_k: expected -1 (off) or >= 1, got {ro.top_k}")
    in_range("rollout.gpu_memory_utilization", ro.gpu_memory_utilization, 0, 1, low_open=True)
    seed_in_range("rollout.seed", ro.seed)
    choice("rollout.sample_seeds", ro.sample_seeds, SAMPLE_SEEDS)
    if ro.engine_in_process and cfg.controller.kind != "ray":
        raise ConfigError(f"rollout.engine_in_process: the engine core runs in the rollout's process, which "
                          f"under controller.kind = {cfg.controller.kind!r} is a trainer rank whose "
                          "torch.distributed world vLLM's worker would join; expected controller.kind: ray")
    if ro.max_new_tokens >= ro.max_model_len:
        raise ConfigError(f"rollout.max_new_tokens: {ro.max_new_tokens} leaves no room for the prompt "
                          f"in rollout.max_model_len = {ro.max_model_len}")


def _check_weight_sync(cfg: TrainConfig) -> None:
    ws = cfg.weight_sync
    positive("weight_sync.bucket_mb", ws.bucket_mb)
    positive("weight_sync.every_steps", ws.every_steps)
    choice("weight_sync.transport", ws.transport, TRANSPORTS)
    choice("weight_sync.tp_export", ws.tp_export, TP_EXPORTS)
    if not ws.host or any(c.isspace() for c in ws.host) or "://" in ws.host:
        raise ConfigError(f"weight_sync.host: expected a host name or IP address (no scheme, no "
                          f"spaces), got {ws.host!r}")


def _check_reward(path: str, reward: str) -> None:
    """A built-in reward or `module:function`; only the format: importing runs user code."""
    if reward in BUILTIN_REWARDS:
        return
    module, _, function = reward.partition(":")
    if not (function.isidentifier() and all(part.isidentifier() for part in module.split("."))):
        raise ConfigError(f"{path}: expected one of {list(BUILTIN_REWARDS)} or 'module:function' "
                          f"(e.g. my_pkg.rewards:score), got {reward!r}")


def _check_task(cfg: TrainConfig) -> None:
    """The synthetic task: known, and its problems fit both the context and the split sizes."""
    data, ro = cfg.data, cfg.rollout
    if data.task is None:
        raise ConfigError("data.train_path: set a prompt file, or data.task for a synthetic task")
    choice("data.task", data.task, TASKS)
    digits = data.task_digits
    positive("data.task_digits", digits)
    prompt_tokens = 2 * digits + 3  # "07+45=" and a BOS; no tokenizer splits an ASCII char further
    # equality is fine: a vLLM teacher scores a sample that fills the rollout's context (its last
    # token through a sampled token's logprobs); the prompts are measured again with the real
    # tokenizer and chat template at start-up (data.build_train_set)
    if prompt_tokens + ro.max_new_tokens > ro.max_model_len:
        raise ConfigError(f"data.task_digits: {digits}-digit prompts take up to {prompt_tokens} tokens "
                          f"(one per character, before any chat template), "
                          f"which with rollout.max_new_tokens = {ro.max_new_tokens} exceed "
                          f"rollout.max_model_len = {ro.max_model_len}")
    total = data.num_train + data.num_eval
    # 10**(2*digits) distinct problems; the digit count is compared first so that a huge
    # task_digits never builds a huge integer
    if 2 * digits < len(str(total)) and total > 10 ** (2 * digits):
        raise ConfigError(f"data.num_train: num_train + num_eval = {total} exceeds the "
                          f"{10 ** (2 * digits)} distinct {digits}-digit addition problems")


def _check_data(cfg: TrainConfig, check_files: bool) -> None:
    data = cfg.data
    for key in ("prompt_key", "answer_key", "data_source_key", "messages_key"):
        non_empty(f"data.{key}", getattr(data, key))
    choice("data.chat_template", data.chat_template, CHAT_TEMPLATES)
    choice("data.overlong", data.overlong, OVERLONG_POLICIES)
    _check_teacher_prompts(data)
    for source, reward in data.rewards.items():
        if not source.strip():
            raise ConfigError(f"data.rewards: expected data_source names as keys, got {source!r}")
        _check_reward(f"data.rewards.{source}", reward)
    positive("data.num_train", data.num_train)
    positive("data.num_eval", data.num_eval, allow_zero=True)
    seed_in_range("data.seed", data.seed)
    if data.train_path is None:
        _check_task(cfg)
    for key in ("train_path", "eval_path"):
        value = getattr(data, key)
        if value is None:
            continue
        if not value.endswith((".jsonl", ".json", ".parquet")):
            raise ConfigError(f"data.{key}: expected a .jsonl or .parquet file, got {value!r}")
        if check_files and not os.path.isfile(value):
            raise ConfigError(f"data.{key}: file {value!r} does not exist")


def _check_teacher_prompts(data) -> None:
    """The teacher's own prompt per record: from one field or one template, never both."""
    choice("data.missing_teacher_prompt", data.missing_teacher_prompt, MISSING_TEACHER_PROMPT_POLICIES)
    key, template = data.teacher_prompt_key, data.teacher_prompt_template
    if key is not None and template is not None:
        raise ConfigError("data.teacher_prompt_template: set either data.teacher_prompt_key (a field holding "
                          "the teacher's prompt) or data.teacher_prompt_template (a template over the "
                          "record's fields), not both")
    if key is not None:
        non_empty("data.teacher_prompt_key", key)
    if template is None:
        return
    try:
        fields = format_fields(template)
    except ValueError as err:
        raise ConfigError(f"data.teacher_prompt_template: {err}; got {template!r}") from None
    if not fields:
        raise ConfigError(f"data.teacher_prompt_template: names no record field (e.g. {{solution}}), so "
                          f"every teacher prompt would be the same text; got {template!r}")


def _check_run(cfg: TrainConfig) -> None:
    run = cfg.run
    positive("run.steps", run.steps)
    seed_in_range("run.seed", run.seed)
    choice("run.schedule", run.schedule, SCHEDULES)
    choice("run.device", run.device, DEVICES)
    if not run.output_dir or not run.output_dir.strip():
        raise ConfigError(f"run.output_dir: expected a directory path, got {run.output_dir!r}")
    positive("checkpoint.save_every", cfg.checkpoint.save_every, allow_zero=True)
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    positive("logging.console_every", cfg.logging.console_every, allow_zero=True)
    if cfg.logging.wandb_project is not None:
        non_empty("logging.wandb_project", cfg.logging.wandb_project)
    for step in cfg.logging.profile_steps:
        if not 0 <= step < run.steps:
            raise ConfigError(f"logging.profile_steps: step {step} is not a step of this run (0 .. "
                              f"run.steps - 1 = {run.steps - 1}); got {cfg.logging.profile_steps}")


def _check_schedule(cfg: TrainConfig) -> None:
    """The schedule and the controller that runs it (see opkd_mcore/controller/)."""
    run, ctl = cfg.run, cfg.controller
    choice("controller.kind", ctl.kind, CONTROLLERS)
    choice("controller.placement", ctl.placement, PLACEMENTS)
    for name in ("rollout_engines", "rollout_tp", "teacher_replicas", "teacher_call_tokens"):
        positive(f"controller.{name}", getattr(ctl, name))
    for name in ("cpus_per_worker", "sync_timeout_s", "call_timeout_s"):
        positive(f"controller.{name}", getattr(ctl, name))
    positive("controller.max_restarts", ctl.max_restarts, allow_zero=True)
    choice("run.stale_policy", run.stale_policy, STALE_POLICIES)
    choice("run.in_flight_update", run.in_flight_update, IN_FLIGHT_UPDATES)
    positive("run.max_staleness", run.max_staleness, allow_zero=True)
    positive("run.partial_rollout_tokens", run.partial_rollout_tokens)
    if not run.is_truncation >= 1.0:  # a cap below 1 would shrink even on-policy samples
        raise ConfigError(f"run.is_truncation: expected >= 1, got {run.is_truncation!r}")
    if run.schedule in OVERLAPPED_SCHEDULES and ctl.kind != "ray":
        raise ConfigError(f"run.schedule: {run.schedule!r} overlaps stages across worker groups and needs "
                          f"controller.kind: ray (the torchrun SPMD job runs sync only), got {ctl.kind!r}")
    if run.schedule != "async" and run.in_flight_update != "finish":
        raise ConfigError(f"run.in_flight_update: only the async schedule updates weights while "
                          f"generations are in flight; got {run.in_flight_update!r} with run.schedule: "
                          f"{run.schedule!r} (use finish)")
    if run.schedule == "async" and cfg.weight_sync.every_steps != 1:
        raise ConfigError(f"weight_sync.every_steps: the async schedule bounds staleness in weight "
                          f"versions, one per optimizer step; expected 1, got {cfg.weight_sync.every_steps}")
    if ctl.teachers_with_rollout and (ctl.placement != "disaggregated" or ctl.rollout_tp != 1):
        raise ConfigError("controller.teachers_with_rollout: teachers join the rollout engines' devices in "
                          f"the disaggregated placement with rollout_tp 1; got placement {ctl.placement!r}, "
                          f"rollout_tp {ctl.rollout_tp}")
    check_colocated(cfg)


def _check_checkpoint_cadence(cfg: TrainConfig) -> None:
    """Periodic checkpoints fall on weight-sync steps: there the rollout engine holds the saved
    student, so a resumed run equals an uninterrupted one (train.checkpoint.rollout_version_on_resume)."""
    every, save = cfg.weight_sync.every_steps, cfg.checkpoint.save_every
    if save and save % every:
        raise ConfigError(f"checkpoint.save_every: {save} is not a multiple of weight_sync.every_steps = "
                          f"{every} (a checkpoint between weight syncs cannot restore the rollout "
                          f"engine's weights); use e.g. {every * -(-save // every)}")


def _check_rest(cfg: TrainConfig, check_files: bool) -> None:
    choice("model.params_dtype", cfg.model.params_dtype, DTYPES)
    choice("model.moe_experts", cfg.model.moe_experts, MOE_EXPERTS)
    _check_rollout(cfg)
    _check_optim(cfg)
    _check_weight_sync(cfg)
    _check_data(cfg, check_files)
    _check_run(cfg)
    _check_schedule(cfg)
    _check_checkpoint_cadence(cfg)


def _check_context_parallel(cfg: TrainConfig) -> None:
    """What CP > 1 shards per token: every loss row is one token of one CP rank, so the loss must be a
    token mean and the teacher's rows must be one per student token. Transformer Engine is checked at
    start-up, where the run's devices are known (`train/preflight.py`)."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    if cfg.parallel.pp != 1:
        raise ConfigError(f"parallel.cp: context parallelism (cp={cp}) runs without pipeline stages here; "
                          f"expected parallel.pp: 1, got {cfg.parallel.pp}")
    if cfg.loss.aggregation != "token-mean":
        raise ConfigError(f"loss.aggregation: with parallel.cp={cp} each rank holds pieces of every "
                          f"sequence; expected token-mean, got {cfg.loss.aggregation!r}")
    if cross_tokenizer_mode(cfg.loss.cross_tokenizer) != "off":
        raise ConfigError(f"loss.cross_tokenizer: the span loss pairs whole sequences; expected off with "
                          f"parallel.cp={cp}")
    prompts = cfg.data.teacher_prompt_key or cfg.data.teacher_prompt_template
    in_step = [i for i, t in enumerate(cfg.teacher.teachers) if runs_in_step(t)]
    if prompts and in_step:
        raise ConfigError(f"teacher.teachers.{in_step[0]}: an in-step teacher on teacher prompts packs "
                          f"sequences of its own, which parallel.cp={cp} does not shard; use parallel.cp: 1")


def _check_sequence_parallel(cfg: TrainConfig) -> None:
    """Between pipeline stages an in-step teacher's hidden states travel in the student's p2p tensor,
    whose sequence sequence parallelism splits over TP and the teacher's (without it) does not."""
    in_step = [i for i, t in enumerate(cfg.teacher.teachers) if runs_in_step(t)]
    if cfg.parallel.sequence_parallel and cfg.parallel.pp > 1 and in_step:
        raise ConfigError(f"parallel.sequence_parallel: an in-step teacher (teacher.teachers.{in_step[0]}) "
                          f"shares the student's pipeline tensors, which sequence parallelism splits; with "
                          f"parallel.pp={cfg.parallel.pp} use sequence_parallel: false")


def validate_config(cfg: TrainConfig, *, check_files: bool = True) -> TrainConfig:
    """Raise `ConfigError` (a ValueError) naming the key path of the first impossible setting."""
    check_finite(cfg, "")
    if not cfg.model.student:
        raise ConfigError("model.student: expected the student's HF checkpoint directory or hub id")
    student_shape = model_shape("model.student", cfg.model.student, check_files)
    tokenizers: dict[str, TokenizerInfo] = {}  # by checkpoint: each tokenizer loaded once
    check_student_vocab(student_shape, load_tokenizer_info("model.student", cfg.model.student,
                                                             tokenizers))
    _check_rest(cfg, check_files)
    check_context("model.student", cfg.model.student, student_shape, cfg.rollout.max_model_len)
    _check_teachers(cfg, student_shape, tokenizers, check_files)
    _check_loss(cfg, student_shape)
    check_cross_tokenizer(cfg, tokenizers)
    check_parallel(cfg, student_shape)
    _check_context_parallel(cfg)
    _check_sequence_parallel(cfg)
    return cfg
