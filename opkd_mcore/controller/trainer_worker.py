"""The trainer group's actor: one Megatron rank of the student.

It runs the code of the torchrun path: `train.components` builds the student (and an in-step Megatron
teacher) and `train.stages.train_stage` takes the optimizer step, so both launches train the same way.
The ranks form their own `torch.distributed` group: rank 0 serves the store on the run's rendezvous
address (`weight_sync.host`, see `WorkerGroups.rendezvous_host`) and a port the OS gives it
(`listen`), and every rank then joins in one `setup` call that the driver awaits for all ranks
together. Teacher rows arrive as object references and each rank pulls only the rows it uses.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.controller.importance import truncated_is_weights
from opkd_mcore.engine.micro_batches import data_parallel_split
from opkd_mcore.models import save_hf_checkpoint
from opkd_mcore.platform import collective_backend
from opkd_mcore.platform.parallel import destroy_parallel
from opkd_mcore.platform.tcp_store import serve_store
from opkd_mcore.rollout import Sample
from opkd_mcore.train import components as c
from opkd_mcore.train import stages
from opkd_mcore.train.checkpoint import (
    EXPORT_DIR,
    TrainerState,
    load_checkpoint,
    require_checkpoint,
    save_checkpoint,
)
from opkd_mcore.train.metrics import step_profile
from opkd_mcore.train.step_report import rollout_metrics
from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport, SyncGroupsConfig

if TYPE_CHECKING:
    from ray import ObjectRef

logger = logging.getLogger(__name__)


@dataclass
class TrainBatch:
    """One optimizer step's input, as the driver sends it (teacher rows stay in the object store)."""

    step: int
    samples: list[Sample]  # prompt-major; group_id = the prompt's place in this batch
    # per sample: (teacher call id, row in its rows), or None when the teacher scores in the step
    rows: list[tuple[int, int] | None]
    # teacher call id -> the reference of the call's list[TeacherOutput] in the object store
    teacher_calls: dict[int, ObjectRef] = field(default_factory=dict)
    stale: list[bool] = field(default_factory=list)  # per sample: past run.max_staleness (truncated_is)
    task_advantages: list[float] | None = None  # per sample (GRPO), computed by the driver
    is_truncation: float = 2.0  # cap of the importance weights of stale samples (run.is_truncation)


@dataclass
class TrainReply:
    metrics: dict[str, float]
    seconds: float  # the optimizer step
    fetch_seconds: float  # pulling teacher rows from the object store


class WeightSyncError(RuntimeError):
    """A weight transfer failed or timed out; the message names the group, the ranks and the bucket."""


def _bucket_in_flight(sender, sent: int) -> str:
    """Which bucket a stage sender was moving when it stopped, from the bytes it had started."""
    done, started = 0, 0
    for bucket in sender.buckets:
        if done + bucket.nbytes > sent:
            break
        done += bucket.nbytes
        started += 1
    if started == 0:
        return f"before bucket 0 of {len(sender.buckets)} (plan handshake)"
    bucket = sender.buckets[started - 1]
    return f"bucket {bucket.index} ({started} of {len(sender.buckets)} started, {sent} bytes)"


class TrainerWorker:
    """Body of one trainer actor (made remote by `controller.groups`)."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        # each actor sees only its own device(s): the local rank is 0
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        self._store = None
        self.weight_sync = None

    # ---- process group -----------------------------------------------------------------------
    def listen(self, host: str | None) -> tuple[str, int]:
        """Rank 0: serve the group's store on `host` only (None: this node's address), on a port the OS
        picks for a socket the store takes over (no pick-then-bind race). The store is not
        authenticated: bound to one address, it is not reachable through the node's other interfaces."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        timeout = timedelta(seconds=self.cfg.controller.call_timeout_s)
        self._store = serve_store(host, self.world_size, timeout)
        return host, self._store.port

    def setup(self, host: str, port: int) -> dict:
        """Join the trainer group and build this rank's student (collective: all ranks at once)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        self.loss_plan = c.loss_plan(cfg)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
        timeout = timedelta(seconds=cfg.controller.call_timeout_s)
        store = self._store or dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(collective_backend(cfg.run.device), store=store, rank=self.rank,
                                world_size=self.world_size, timeout=timeout)
        c.init_distributed(cfg)  # Megatron groups, seeds, CPU emulation (the process group exists)
        # built exactly as a torchrun rank is (in-step teacher, hidden-state teacher head, MoE loss)
        self.engine, self.chunks, self.shard, self.tp_group = c.build_trainer_rank(cfg)
        return {"rank": self.rank, "dp_rank": self.shard.dp_rank, "tp_rank": self.shard.tp_rank,
                "pp_rank": ps.get_pipeline_model_parallel_rank()}

    def reset(self) -> None:
        """A fresh student (weights and optimizer) from the initial checkpoint: benchmarks start every
        schedule there."""
        self.close_weight_sync()  # its plan reads the old model's tensors; the driver binds anew
        self.engine, self.chunks, self.shard, self.tp_group = c.build_trainer_rank(self.cfg)

    # ---- weight sync -------------------------------------------------------------------------
    def bind_weight_sync(self, host: str | None, num_receivers: int, transport: str) -> list[dict]:
        """Stage owners hold their group ports (collective over the trainer ranks); returns the groups.
        `host` None: this node's address (the engines may be on other nodes)."""
        import ray

        # a rebuilt group replaces the old one after an engine died: leave it without waiting for
        # that engine (a normal rebuild closed both ends together first, and there is none)
        self.close_weight_sync(abort=True)
        ws, ctl = self.cfg.weight_sync, self.cfg.controller
        groups = SyncGroupsConfig(host=host or ray.util.get_node_ip_address(), base_port=0,
                                  num_receivers=num_receivers, timeout_s=ctl.sync_timeout_s,
                                  bucket_bytes=ws.bucket_mb << 20, transport=transport,
                                  tp_export=ws.tp_export, high_priority=ws.high_priority_stream)
        self.weight_sync = MegatronWeightExport(self.chunks, groups, fresh_params=self.engine.fresh_params)
        return [dataclasses.asdict(g) for g in self.weight_sync.bind()]

    def connect_weight_sync(self) -> None:
        self.weight_sync.connect()

    def sync_weights(self, version: int) -> float:
        """Export and send this rank's stage as `version`; returns seconds. Errors name the bucket."""
        start = time.perf_counter()
        sender = self.weight_sync.sender
        sent_before = sender.stats.bytes_sent if sender is not None else 0
        try:
            self.weight_sync.sync(version)
        except Exception as err:
            where = "a TP peer of the sender"
            if sender is not None:
                g = sender.transport.cfg
                where = (f"group {g.host}:{g.port} (stage {sender.stage}, group ranks 0..{g.world_size - 1}: "
                         f"sender = trainer rank {self.rank}), "
                         f"{_bucket_in_flight(sender, sender.stats.bytes_sent - sent_before)}")
            raise WeightSyncError(f"weight sync v{version} failed on trainer rank {self.rank}: {where}: "
                                  f"{type(err).__name__}: {err}") from err
        return time.perf_counter() - start

    def close_weight_sync(self, abort: bool = False) -> None:
        """Leave the weight-sync group; `abort` when an engine of it is gone (see
        `MegatronWeightExport.close`).
        The driver aborts from the actor's control thread while `sync_weights` may still run here."""
        weight_sync, self.weight_sync = self.weight_sync, None
        if weight_sync is not None:
            weight_sync.close(abort)

    # ---- training ----------------------------------------------------------------------------
    def _rows_needed(self, samples: list) -> range | list:
        """Rows this rank reads: all on rank 0 (it reports the batch's metrics) or with TCAD weights
        (softmax over whole groups); its DP slice on the last stage; none on other stages."""
        if self.rank == 0 or self.cfg.loss.confidence_alpha:
            return range(len(samples))
        if not self.engine.is_last_stage:
            return []
        by_tokens = self.cfg.parallel.max_tokens_per_micro_batch is not None
        return data_parallel_split([len(s.sequence) for s in samples], self.shard.dp_size,
                                   balance_tokens=by_tokens)[self.shard.dp_rank]

    def train(self, batch: TrainBatch) -> TrainReply:
        with step_profile(self.cfg.logging, self.cfg.run.output_dir, batch.step):
            return self._train(batch)

    def _train(self, batch: TrainBatch) -> TrainReply:
        import ray

        start = time.perf_counter()
        rows = [None] * len(batch.samples)
        needed = [i for i in self._rows_needed(batch.samples) if batch.rows[i] is not None]
        call_ids = sorted({batch.rows[i][0] for i in needed})
        fetched = dict(zip(call_ids, ray.get([batch.teacher_calls[c] for c in call_ids])))
        for i in needed:
            call, row = batch.rows[i]
            rows[i] = stages.paired_rows(fetched[call][row], batch.samples[i])
        fetch_s = time.perf_counter() - start
        scored = stages.ScoredBatch(samples=batch.samples, teacher=rows,
                                    task_advantages=batch.task_advantages)
        weights, extra = None, {}
        if any(batch.stale):
            weights, extra = truncated_is_weights(self.engine, batch.samples, batch.stale, self.cfg.parallel,
                                                  self.shard, batch.is_truncation)
        result = stages.train_stage(self.engine, scored, self.loss_plan, self.cfg.parallel, self.shard,
                                    self.tp_group, sequence_weights=weights)
        metrics = {**result.metrics, **extra}
        if self.rank == 0:
            metrics.update(rollout_metrics(scored))
        return TrainReply(metrics=metrics, seconds=result.seconds, fetch_seconds=fetch_s)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, out: str, state: dict, config_yaml: str, keep_last: int) -> str:
        return save_checkpoint(out, self.engine, TrainerState(**state), config_yaml, keep_last)

    def load(self, out: str) -> dict:
        return dataclasses.asdict(load_checkpoint(require_checkpoint(out), self.engine))

    def export_hf(self, out: str) -> None:
        self.engine.fresh_params()
        save_hf_checkpoint(self.chunks, os.path.join(out, EXPORT_DIR), src_hf_dir=self.cfg.model.student)

    def shutdown(self) -> None:
        self.close_weight_sync()
        destroy_parallel(destroy_process_group=True)
