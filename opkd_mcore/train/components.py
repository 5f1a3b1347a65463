"""Build the parts of a run from its config: parallel state, student engine, rollout engine,
teacher(s) and the weight-sync link between the student and the rollout engine.

In an SPMD job (torchrun) every rank holds its Megatron shard; the vLLM rollout engine and the
in-process teachers live on global rank 0 (colocated), and their results are shared with the other
ranks by `stages.share_from_rank0`.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from opkd_mcore.config.loss_rules import teacher_kind, teacher_output
from opkd_mcore.config.model_checks import load_run_tokenizer
from opkd_mcore.config.schema import OptimSection, TrainConfig
from opkd_mcore.data import Overlong, PromptSampler, build_train_set
from opkd_mcore.data.rewards import TaskRewards
from opkd_mcore.engine.megatron_engine import MegatronEngine
from opkd_mcore.losses.plan import LossPlan, resolve_loss_plan
from opkd_mcore.models import TORCH_DTYPES, build_model, load_hf_config, load_hf_weights
from opkd_mcore.models.builder import memory_overrides, padded_vocab_size
from opkd_mcore.platform import device_type, is_cpu, is_rank0
from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
from opkd_mcore.rollout import RolloutConfig, VllmRollout
from opkd_mcore.train.checkpoint import load_checkpoint, require_checkpoint, rollout_version_on_resume
from opkd_mcore.train.loop import DistillationRun
from opkd_mcore.train.samples_log import write_skipped
from opkd_mcore.train.stages import ShardLayout
from opkd_mcore.train.teacher_setup import (
    build_in_step_teacher,
    build_scoring_teacher,
    in_step_endpoint,
    in_step_model,
    with_hidden_teacher_head,
)
from opkd_mcore.weight_sync.engine_link import SpmdWeightSync
from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport, SyncGroupsConfig
from opkd_mcore.weight_sync.vllm_handle import RECEIVER_CLS, VllmReceiverHandle

logger = logging.getLogger(__name__)

def init_distributed(cfg: TrainConfig) -> None:
    """torch.distributed + Megatron groups + seeds for the run's layout."""
    # Megatron's modules must be imported before the CPU emulation patches torch's device module:
    # their import-time torch.compile builds dynamo's rule table, which rejects the patched functions.
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    from torch._dynamo.trace_rules import get_torch_obj_rule_map

    get_torch_obj_rule_map()

    par = cfg.parallel
    init_parallel(ParallelConfig(tp=par.tp, pp=par.pp, vpp=par.vpp, cp=par.cp, ep=par.ep, etp=par.etp,
                                 seed=cfg.run.seed), device=cfg.run.device)


def shard_layout(engine) -> ShardLayout:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return ShardLayout(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                       tp_rank=ps.get_tensor_model_parallel_rank(),
                       vocab_local=engine.padded_vocab_size // tp, padded_vocab=engine.padded_vocab_size,
                       vocab_size=engine.vocab_size)


def build_student(model_dir: str, optim: OptimSection | None, params_dtype: str = "float32", *,
                  padded_vocab: int | None = None, teacher=None, moe_aux_loss_coef: float = 0.0,
                  recompute: str = "none", sequence_parallel: bool = False, moe_experts: str = "auto"):
    """Megatron chunks of this rank loaded from an HF checkpoint, wrapped in a `MegatronEngine`
    (with `teacher`, an `InStepTeacher`, run inside each training step; or a function of the
    student's chunks that builds one: a self teacher with the current weights runs the chunks
    themselves). An MoE student gets the router load-balancing loss when `moe_aux_loss_coef` > 0,
    and the experts module `moe_experts` (`model.moe_experts`); `recompute` / `sequence_parallel`:
    `parallel.recompute` / `parallel.sequence_parallel`."""
    moe = {"moe_aux_loss_coeff": moe_aux_loss_coef} if moe_aux_loss_coef else {}
    chunks = build_model(load_hf_config(model_dir), params_dtype=TORCH_DTYPES[params_dtype],
                         padded_vocab=padded_vocab, moe_experts=moe_experts, **moe,
                         **memory_overrides(recompute, sequence_parallel))
    load_hf_weights(chunks, model_dir)
    if callable(teacher):
        teacher = teacher(chunks)
    return MegatronEngine(chunks, optim, teacher=teacher), chunks


def student_vocab_size(cfg: TrainConfig) -> int:
    """Token ids the student (and its rollout engine) can emit: its HF `vocab_size`."""
    return load_hf_config(cfg.model.student).vocab_size


def shared_padded_vocab(cfg: TrainConfig) -> tuple[int, int]:
    """(padded vocabulary rows, the student's vocabulary): one layout for the student and an
    in-step teacher, so row r of both logits shards is the same token id."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    student_vocab = student_vocab_size(cfg)
    padded = padded_vocab_size(student_vocab, tp)
    t = in_step_endpoint(cfg)
    if t is not None:
        padded = max(padded, padded_vocab_size(load_hf_config(in_step_model(cfg, t)).vocab_size, tp))
    return padded, student_vocab


def task_rewards(cfg: TrainConfig):
    """The reward functions of the run (rank 0 scores the samples), or None without task rewards."""
    if not cfg.loss.task_reward_coef or not is_rank0():
        return None

    return TaskRewards(cfg.data.rewards)


def loss_plan(cfg: TrainConfig) -> LossPlan:
    """The run's loss path (`losses/plan.py`), decided once before anything runs, for this device, the
    student's dtype and the run's teacher; `ConfigError` naming the key when a request cannot run."""
    return resolve_loss_plan(cfg.loss, device=device_type(cfg.run.device),
                             dtype=TORCH_DTYPES[cfg.model.params_dtype],
                             teacher_kind=teacher_kind(cfg.teacher.teachers))


def build_rollout(cfg: TrainConfig, model_dir: str | None = None, tensor_parallel_size: int = 1,
                  sleep_mode: bool = False):
    """The student's vLLM engine (rank 0 only; under the Ray controller, each rollout actor), with the
    weight receiver mixed into its workers; `sleep_mode`: it can free its memory while a colocated
    trainer trains."""
    ro = cfg.rollout
    # raw logprobs (before temperature / top-p): the student's logprobs in the policy-gradient
    # form are at T=1 too, so the importance ratio compares like with like at any temperature
    # a self teacher with top-k output scores with this engine: it returns that many logprobs too
    self_k = [t.top_k for t in cfg.teacher.teachers if t.backend == "self" and teacher_output(t) == "topk"]
    rc = RolloutConfig(dtype=cfg.model.params_dtype, max_model_len=ro.max_model_len,
                       tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=sleep_mode,
                       gpu_memory_utilization=ro.gpu_memory_utilization,
                       enforce_eager=ro.enforce_eager, seed=ro.seed, max_logprobs=max([1, *self_k]),
                       logprobs_mode="raw_logprobs", per_sample_seeds=ro.sample_seeds == "per_sample",
                       engine_in_process=ro.engine_in_process)
    return VllmRollout(model_dir or cfg.model.student, rc, worker_extension_cls=RECEIVER_CLS)


def optim_config(cfg: TrainConfig) -> OptimSection:
    optim = dataclasses.replace(cfg.optim)
    if optim.lr_decay_style != "constant" and optim.lr_decay_steps is None:
        optim.lr_decay_steps = cfg.run.steps
    return optim


def colocated_transport(name: str, device: str | None) -> str:
    """The transport for a rollout engine on rank 0's own device (the torchrun layout): "auto" is
    device IPC on an accelerator (one device cannot be two ranks of an accelerator group) and the
    gloo group on CPU."""
    if name != "auto":
        return name
    return "group" if is_cpu(device) else "colocated_ipc"


def build_weight_sync(chunks, rollout: VllmRollout | None, cfg: TrainConfig,
                      port: int | None = None, fresh_params=None) -> SpmdWeightSync:
    """The connected weight sync of the torchrun layout: student (Megatron, every rank) -> rollout
    engine (vLLM on rank 0, `rollout` there, None elsewhere), over per-stage groups. `fresh_params`:
    the student engine's `fresh_params`, run before every export."""
    # a wanted port (moved if taken) or 0: stage owners bind a free port and tell the engine
    port = port or int(os.environ.get("OPKD_SYNC_PORT", "0"))
    groups_cfg = SyncGroupsConfig(host=cfg.weight_sync.host, base_port=port,
                                  bucket_bytes=cfg.weight_sync.bucket_mb << 20,
                                  transport=colocated_transport(cfg.weight_sync.transport, cfg.run.device),
                                  tp_export=cfg.weight_sync.tp_export,
                                  high_priority=cfg.weight_sync.high_priority_stream)
    # the rollout salts its prefix cache with the weight version: no reset per sync
    handle = VllmReceiverHandle(rollout.llm, reset_prefix_cache=False) if rollout is not None else None
    export = MegatronWeightExport(chunks, groups_cfg, fresh_params=fresh_params)
    sync = SpmdWeightSync(export, handle, rollout)
    sync.connect()
    return sync


def build_trainer_rank(cfg: TrainConfig):
    """This rank's student once `init_distributed` has run: (engine with the in-step teacher inside,
    model chunks, shard layout, TP group). The SPMD path (`build_run`) and the Ray controller's
    trainer actors both build their ranks here, so they train the same way."""
    from megatron.core import parallel_state as ps

    padded_vocab, student_vocab = shared_padded_vocab(cfg)
    in_step = build_in_step_teacher(cfg, padded_vocab, student_vocab)
    engine, chunks = build_student(cfg.model.student, optim_config(cfg), cfg.model.params_dtype,
                                   padded_vocab=padded_vocab, teacher=in_step,
                                   moe_aux_loss_coef=cfg.loss.moe_aux_loss_coef,
                                   recompute=cfg.parallel.recompute,
                                   sequence_parallel=cfg.parallel.sequence_parallel,
                                   moe_experts=cfg.model.moe_experts)
    shard = with_hidden_teacher_head(cfg, shard_layout(engine), TORCH_DTYPES[cfg.model.params_dtype],
                                     engine.device)
    return engine, chunks, shard, ps.get_tensor_model_parallel_group()


def load_train_data(cfg: TrainConfig):
    """(student tokenizer, the prompts to sample from, the skipped ones), before any engine starts:
    every row of the data files checked and every prompt measured against the rollout's context
    (`data.build_train_set`; a `DataError` names each bad row). Both launch paths call it."""
    tokenizer = load_run_tokenizer("model.student", cfg.model.student)
    train_set, skipped = build_train_set(cfg, tokenizer)
    return tokenizer, train_set, skipped


def record_skipped(cfg: TrainConfig, train_set, skipped) -> None:
    """Rank 0, once the output directory is accepted: say how many prompts `data.overlong: skip`
    left out, and list them in skipped_prompts.jsonl (rewritten, empty when none)."""
    if not is_rank0():
        return
    path = write_skipped(cfg.run.output_dir, [o.to_dict() for o in skipped])
    total = len(skipped) + len(train_set)
    overlong = [o for o in skipped if isinstance(o, Overlong)]
    if overlong:
        ro = cfg.rollout
        logger.warning("data.overlong: skip: %d of %d prompts of %s leave no room for rollout.max_new_tokens "
                       "= %d in rollout.max_model_len = %d; training on the other %d (the skipped ones are "
                       "listed in %s)", len(overlong), total, train_set.name,
                       ro.max_new_tokens, ro.max_model_len, len(train_set), path)
    if len(overlong) < len(skipped):
        logger.warning("data.missing_teacher_prompt: skip: %d of %d records of %s have no teacher prompt; "
                       "training on the other %d (the skipped ones are listed in %s)",
                       len(skipped) - len(overlong), total, train_set.name, len(train_set), path)


def build_run(cfg: TrainConfig, *, resume: bool = False):
    """Every part of a run on this rank (`loop.DistillationRun`), restored from the latest
    checkpoint when `resume` (one must exist; the rollout engine then gets the restored weights)."""
    plan = loss_plan(cfg)
    # the data first: a bad row or an overlong prompt is refused before minutes of engine start-up
    tokenizer, train_set, skipped = load_train_data(cfg)
    record_skipped(cfg, train_set, skipped)
    # vLLM engines before `init_distributed`: importing vLLM after the CPU emulation is on trips
    # torch.compile
    rollout = build_rollout(cfg) if is_rank0() else None
    teacher = build_scoring_teacher(cfg, student_vocab_size(cfg), rollout) if is_rank0() else None
    init_distributed(cfg)
    engine, chunks, shard, tp_group = build_trainer_rank(cfg)
    syncer = build_weight_sync(chunks, rollout, cfg, fresh_params=engine.fresh_params)
    sampler = PromptSampler(len(train_set), cfg.rollout.prompts_per_step, seed=cfg.data.seed,
                            shuffle=cfg.data.shuffle)
    run = DistillationRun(cfg=cfg, engine=engine, chunks=chunks, rollout=rollout, teacher=teacher,
                          syncer=syncer, tokenizer=tokenizer, dataset=train_set, sampler=sampler, shard=shard,
                          loss_plan=plan, tp_group=tp_group, rewards=task_rewards(cfg))
    if resume:  # `entry.train` has checked the directory already; nothing to resume is an error
        run.state = load_checkpoint(require_checkpoint(cfg.run.output_dir), engine)
        sampler.load_state_dict(run.state.sampler)
        # the engine restarted from the initial checkpoint: give it the restored weights, under the
        # version the uninterrupted run's engine had (a new one if the checkpoint is between syncs)
        run.state.weight_version = rollout_version_on_resume(run.state, cfg.weight_sync.every_steps)
        syncer.sync(run.state.weight_version)
    return run


def close_run(run) -> None:
    """Stop engines and tear down the parallel state."""
    run.syncer.close()
    if run.teacher is not None:
        run.teacher.close()
    if run.rollout is not None:
        run.rollout.shutdown()
    destroy_parallel()
