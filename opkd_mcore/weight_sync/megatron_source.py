"""Weight sync from a Megatron job: which ranks export, which rank of each PP stage sends.

Each PP stage has one owner (TP rank 0 of data-parallel replica 0, CP rank 0) that sends its own
stage's tensors over that stage's group, so no rank ever holds more than its stage's two buckets and
stages never funnel through one rank. The other TP ranks of replica 0 take part in the export
(the TP gather is collective) and send nothing; the other replicas do nothing.

Ports: `bind()` (every trainer rank) lets each stage owner take its group's port — the configured one,
or a free one when that is taken or the base port is 0 — and agrees the ports over the trainer's
default group, so `groups` then holds the ports to hand to the rollout workers. Nothing chooses a
port by binding and releasing it, which another process could take in between.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from opkd_mcore.platform import current_device

from opkd_mcore.weight_sync.plan import DEFAULT_BUCKET_BYTES, BucketPlan
from opkd_mcore.weight_sync.sender import SenderStats, WeightSender
from opkd_mcore.weight_sync.transport import TransportConfig, make_transport

logger = logging.getLogger(__name__)


@dataclass
class SyncGroupsConfig:
    """Where the per-stage weight-sync groups meet."""

    host: str = "127.0.0.1"  # address of the trainer node holding the stage owners (multi-node: its IP)
    base_port: int = 29700  # stage s asks for base_port + s; 0: free ports picked at bind()
    num_receivers: int = 1  # rollout workers that receive (all engines' workers together)
    timeout_s: float = 300.0  # each transfer must finish within this
    join_timeout_s: float | None = None  # group creation (waits for the engine to start); None = timeout_s
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # bucket size of the plan (a larger tensor goes alone)
    transport: str = "group"  # a name registered in weight_sync.transport.TRANSPORTS

    def stage_groups(self, num_stages: int) -> list[TransportConfig]:
        base = TransportConfig(host=self.host, world_size=1 + self.num_receivers, timeout_s=self.timeout_s,
                               join_timeout_s=self.join_timeout_s)
        return [replace(base, port=self.base_port + s if self.base_port else 0) for s in range(num_stages)]


def _ranks():
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_context_parallel_rank())


def takes_part_in_export() -> bool:
    """True on the ranks that run the (TP-collective) export: data-parallel replica 0, CP rank 0."""
    _, _, _, dp, cp = _ranks()
    return dp == 0 and cp == 0


def is_stage_owner() -> bool:
    """True on the one rank per PP stage that sends that stage's tensors."""
    _, _, tp, _, _ = _ranks()
    return takes_part_in_export() and tp == 0


class MegatronWeightSync:
    """Build once after the model exists; call `sync(version)` after every optimizer step."""

    def __init__(self, model_chunks, cfg: SyncGroupsConfig):
        from opkd_mcore.models import hf_weight_metadata

        self.model_chunks, self.cfg = model_chunks, cfg
        stage, num_stages, *_ = _ranks()
        self.plan = BucketPlan.from_metadata(hf_weight_metadata(model_chunks), cfg.bucket_bytes)
        self.groups = cfg.stage_groups(num_stages)
        self.sender: WeightSender | None = None
        if is_stage_owner():
            transport = make_transport(cfg.transport, self.groups[stage], rank=0)
            self.sender = WeightSender(self.plan, transport, stage)

    def bind(self) -> list[TransportConfig]:
        """Collective over every trainer rank: stage owners hold their group's port (moving to a free
        one if it is taken), then all ranks agree on the ports; returns `groups` for the receivers."""
        stage = _ranks()[0]
        port = self.sender.transport.bind() if self.sender is not None else 0
        ports = agree_stage_ports(stage, port, len(self.groups))
        self.groups = [replace(g, port=p) for g, p in zip(self.groups, ports)]
        return self.groups

    def connect(self) -> None:
        """Stage owners join their group; rollout workers must be joining concurrently, on the ports
        of `groups` (after `bind()`, the ports actually held; without it, exactly the configured ones)."""
        if self.sender is not None:
            self.sender.transport.connect()

    def sync(self, version: int) -> SenderStats | None:
        """Export and send this stage (collective over TP); raises on every exporting rank on failure."""
        from opkd_mcore.models import iter_hf_weights

        if not takes_part_in_export():
            return None
        stream = iter_hf_weights(self.model_chunks, stages="local")
        error: BaseException | None = None
        try:
            if self.sender is not None:
                self.sender.sync(stream, version)
        except Exception as err:  # noqa: BLE001  (re-raised below, after the TP peers are released)
            error = err
        for _ in stream:  # TP peers block in the export's gathers until the owner has walked it all
            pass
        _agree_over_tp(error)
        return self.sender.stats if self.sender is not None else None

    def close(self) -> None:
        if self.sender is not None:
            self.sender.transport.close()


def agree_stage_ports(stage: int, port: int, num_stages: int, group=None) -> list[int]:
    """Every rank learns each stage's port: a stage owner passes the port it holds, others 0."""
    ports = torch.zeros(num_stages, dtype=torch.int64, device=current_device())
    ports[stage] = port
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(ports, op=dist.ReduceOp.MAX, group=group)
    agreed = ports.tolist()
    if not all(agreed):
        raise RuntimeError(f"weight sync: no stage owner reported a port for stages "
                           f"{[s for s, p in enumerate(agreed) if not p]} (ports {agreed})")
    return agreed


def _agree_over_tp(error: BaseException | None) -> None:
    from megatron.core import parallel_state as ps

    failed = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=current_device())
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("weight sync failed on this stage's sending rank (TP rank 0); see its log")
