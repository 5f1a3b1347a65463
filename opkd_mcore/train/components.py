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

import torch
import torch.distributed as dist

from opkd_mcore.config.schema import TeacherSection, TrainConfig
from opkd_mcore.train.optim import OptimConfig
from opkd_mcore.train.stages import ShardLayout

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_rank0() -> bool:
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def init_distributed(cfg: TrainConfig) -> None:
    """torch.distributed + Megatron groups + seeds for the run's layout."""
    # Megatron's modules must be imported before the CPU emulation patches torch's device module:
    # their import-time torch.compile builds dynamo's rule table, which rejects the patched functions.
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    from torch._dynamo.trace_rules import get_torch_obj_rule_map

    get_torch_obj_rule_map()

    from opkd_mcore.platform.parallel import ParallelConfig, init_parallel

    par = cfg.parallel
    init_parallel(ParallelConfig(tp=par.tp, pp=par.pp, vpp=par.vpp, cp=par.cp, ep=par.ep,
                                 seed=cfg.run.seed), device=cfg.run.device)


def shard_layout(engine) -> ShardLayout:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return ShardLayout(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                       tp_rank=ps.get_tensor_model_parallel_rank(),
                       vocab_local=engine.padded_vocab_size // tp, padded_vocab=engine.padded_vocab_size)


def build_student(model_dir: str, optim: OptimConfig | None, params_dtype: str = "float32"):
    """Megatron chunks of this rank loaded from an HF checkpoint, wrapped in a `MegatronEngine`."""
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
    from opkd_mcore.train.engine import MegatronEngine

    chunks = build_model(load_hf_config(model_dir), params_dtype=DTYPES[params_dtype])
    load_hf_weights(chunks, model_dir)
    return MegatronEngine(chunks, optim), chunks


def build_rollout(cfg: TrainConfig, model_dir: str | None = None):
    """The student's vLLM engine (rank 0 only), with the weight receiver mixed into its workers."""
    from opkd_mcore.rollout import RolloutConfig, VllmRollout
    from opkd_mcore.weight_sync.vllm_handle import RECEIVER_CLS

    ro = cfg.rollout
    rc = RolloutConfig(dtype=cfg.model.params_dtype, max_model_len=ro.max_model_len,
                       gpu_memory_utilization=ro.gpu_memory_utilization,
                       enforce_eager=ro.enforce_eager, seed=ro.seed, max_logprobs=1)
    return VllmRollout(model_dir or cfg.model.student, rc, worker_extension_cls=RECEIVER_CLS)


def _one_teacher(t, cfg: TrainConfig):
    if t.backend == "vllm":
        from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

        return VllmTeacher(t.model, VllmTeacherConfig(
            k=t.top_k, max_model_len=cfg.rollout.max_model_len, seed=cfg.rollout.seed,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization))
    if t.backend == "remote":
        from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher

        return RemoteVllmTeacher(RemoteTeacherConfig(url=t.url, k=t.top_k))
    from opkd_mcore.teacher.hf_teacher import TransformersTeacher

    if t.backend == "hf":
        return TransformersTeacher(t.model, k=t.top_k)
    # "megatron" (dense): full-vocabulary logits of one forward on rank 0, cut into TP shards by the
    # trainer. A TP-sharded Megatron teacher engine would slot in here.
    # raw logits: kd_loss applies loss.temperature to dense teacher logits itself
    return TransformersTeacher(t.model, k=None)


def _replicas(t, cfg: TrainConfig) -> list:
    return [_one_teacher(dataclasses.replace(t, url=url), cfg) for url in [t.url, *t.replica_urls]] \
        if t.replica_urls else [_one_teacher(t, cfg)]


def build_teacher(cfg: TrainConfig):
    """One teacher, or a router over several (by data source) and their replicas; rank 0 only."""
    tcfg: TeacherSection = cfg.teacher
    if len(tcfg.teachers) == 1 and not tcfg.teachers[0].replica_urls:
        return _one_teacher(tcfg.teachers[0], cfg)
    from opkd_mcore.teacher.router import TeacherRouter

    teachers = {t.name: _replicas(t, cfg) for t in tcfg.teachers}
    default = next((t.name for t in tcfg.teachers if not t.data_sources), None)
    return TeacherRouter(teachers, field="teacher", default=default)


def route_data(cfg: TrainConfig, data: dict) -> dict:
    """Per-prompt data with the teacher it is routed to under key `teacher`."""
    source = data.get("data_source")
    for t in cfg.teacher.teachers:
        if source in t.data_sources:
            return {**data, "teacher": t.name}
    return dict(data)


def optim_config(cfg: TrainConfig) -> OptimConfig:
    optim = dataclasses.replace(cfg.optim)
    if optim.lr_decay_style != "constant" and optim.lr_decay_steps is None:
        optim.lr_decay_steps = cfg.run.steps
    return optim


class WeightSyncer:
    """Student (Megatron, every rank) -> rollout engine (vLLM on rank 0), over per-stage groups."""

    def __init__(self, chunks, rollout, cfg: TrainConfig, port: int | None = None):
        from opkd_mcore.weight_sync.megatron_source import MegatronWeightSync, SyncGroupsConfig
        from opkd_mcore.weight_sync.vllm_handle import VllmSyncHandle

        port = port or int(os.environ.get("OPKD_SYNC_PORT", "0")) or _shared_free_port()
        self.groups_cfg = SyncGroupsConfig(base_port=port, bucket_bytes=cfg.weight_sync.bucket_mb << 20,
                                           transport=cfg.weight_sync.transport)
        self.source = MegatronWeightSync(chunks, self.groups_cfg)
        self.rollout = rollout
        self.handle = VllmSyncHandle(rollout.llm) if rollout is not None else None
        self.timeout_s = self.groups_cfg.timeout_s
        self._connect()

    def _connect(self) -> None:
        from opkd_mcore.weight_sync.vllm_handle import run_concurrently

        if self.handle is None:
            self.source.connect()
            return
        from megatron.core import parallel_state as ps

        groups = self.groups_cfg.stage_groups(ps.get_pipeline_model_parallel_world_size())
        run_concurrently({"rollout join": lambda: self.handle.join_async(groups).result(),
                          "trainer join": self.source.connect}, self.timeout_s)

    def sync(self, version: int) -> None:
        from opkd_mcore.weight_sync.vllm_handle import run_concurrently

        if self.handle is None:
            self.source.sync(version)
            return
        self.rollout.pause()
        try:
            run_concurrently({"receive": lambda: self.handle.receive_async().result(),
                              "send": lambda: self.source.sync(version)}, self.timeout_s)
            self.rollout.set_weight_version(version)
        finally:
            self.rollout.resume()

    def close(self) -> None:
        self.source.close()
        if self.handle is not None:
            self.handle.close()


def _shared_free_port() -> int:
    """A free port chosen on rank 0 and agreed by all ranks."""
    import socket

    from opkd_mcore.train.stages import share_from_rank0

    port = None
    if is_rank0():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return share_from_rank0(port)


def build_run(cfg: TrainConfig, *, resume: bool = False):
    """Every part of a run on this rank (`loop.DistillationRun`), restored from the latest
    checkpoint when `resume` and one exists (the rollout engine then gets the restored weights)."""
    from transformers import AutoTokenizer

    from opkd_mcore.data import PromptSampler, build_datasets
    from opkd_mcore.train.checkpoint import latest_checkpoint, load_checkpoint
    from opkd_mcore.train.loop import DistillationRun

    # vLLM engines first: importing vLLM after the CPU emulation is on trips torch.compile
    rollout = build_rollout(cfg) if is_rank0() else None
    teacher = build_teacher(cfg) if is_rank0() else None
    init_distributed(cfg)
    engine, chunks = build_student(cfg.model.student, optim_config(cfg), cfg.model.params_dtype)
    syncer = WeightSyncer(chunks, rollout, cfg)
    train_set, _ = build_datasets(cfg.data)
    sampler = PromptSampler(len(train_set), cfg.rollout.prompts_per_step, seed=cfg.data.seed,
                            shuffle=cfg.data.shuffle)
    from megatron.core import parallel_state as ps

    run = DistillationRun(cfg=cfg, engine=engine, chunks=chunks, rollout=rollout, teacher=teacher,
                          syncer=syncer, tokenizer=AutoTokenizer.from_pretrained(cfg.model.student),
                          dataset=train_set, sampler=sampler, shard=shard_layout(engine),
                          tp_group=ps.get_tensor_model_parallel_group())
    path = latest_checkpoint(cfg.run.output_dir) if resume else None
    if path is not None:
        run.state = load_checkpoint(path, engine)
        sampler.load_state_dict(run.state.sampler)
        # the engine restarted from the initial checkpoint: give it the restored weights
        syncer.sync(run.state.weight_version)
    elif resume:
        logger.info("--resume: no checkpoint under %s, starting from step 0", cfg.run.output_dir)
    return run


def close_run(run) -> None:
    """Stop engines and tear down the parallel state."""
    from opkd_mcore.platform.parallel import destroy_parallel

    run.syncer.close()
    if run.teacher is not None:
        run.teacher.close()
    if run.rollout is not None:
        run.rollout.shutdown()
    destroy_parallel()
