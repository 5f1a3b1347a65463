"""Weight sync from a Megatron job (`MegatronWeightExport`): which ranks export, which rank sends what.

The tensors are split into *sources*, one sending rank and one group each: source
`pp_stage * ep + ep_rank`. Source (s, 0) carries stage s's shared tensors (everything but routed
experts) and EP rank 0's experts; source (s, e > 0) carries only EP rank e's experts (dense models:
ep = 1, one source per stage). So no rank ever holds more than its source's two buckets, stages
never funnel through one rank, and each EP rank's experts leave from that rank: nothing gathers the
experts of other EP ranks.

Who takes part: the shared tensors are exported by data-parallel replica 0 (CP rank 0), TP-gathered,
and sent by its TP rank 0; EP rank e's experts by expert-data-parallel replica 0 of that EP rank,
gathered over expert TP, and sent by its expert-TP rank 0. In Megatron's rank order the first rank
of a stage is both TP rank 0 of replica 0 and expert-TP rank 0 of EP rank 0, so source (s, 0) has
one sender (checked). A rank walks its sources in order.

Receive order: where every rank takes part in the export of one source at most (as with TP = 1),
each sender waits for nothing but the receivers, so the receivers take the buckets of all sources
merged layer by layer (`BucketPlan.receive_sequence`): an MoE layer is complete once each EP rank's
part of it has arrived, and vLLM holds about one layer at a time. A rank that takes part in two
sources (e.g. a TP peer of the shared tensors that sends its EP rank's experts: TP > 1 with expert
TP 1) walks the first one to its end before it sends the second, so there the receivers drain the
sources one after another ("source" order), which that walk cannot block (`receive_order`).

Ports: `bind()` (every trainer rank) lets each stage owner take its group's port — the configured one,
or a free one when that is taken or the base port is 0 — and agrees the ports over the trainer's
default group, so `groups` then holds the ports to hand to the rollout workers. Nothing chooses a
port by binding and releasing it, which another process could take in between.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from opkd_mcore.models import hf_weight_metadata, iter_hf_weights
from opkd_mcore.platform import current_device
from opkd_mcore.weight_sync.copy_replay import BucketReplay, ModelStorages, replay_over
from opkd_mcore.weight_sync.peer_export import TP_EXPORTS, PeerExport
from opkd_mcore.weight_sync.plan import DEFAULT_BUCKET_BYTES, BucketPlan
from opkd_mcore.weight_sync.sender import BucketSender, SenderStats
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
    tp_export: str = "auto"  # TP > 1, dense: peer (TP ranks write into the sender's buckets) | gather | auto
    high_priority: bool = True  # the groups' transfers run on a high-priority device stream

    def stage_groups(self, num_stages: int) -> list[TransportConfig]:
        """One group per source (`num_stages` = pp * ep; pp for a dense model)."""
        base = TransportConfig(host=self.host, world_size=1 + self.num_receivers, timeout_s=self.timeout_s,
                               join_timeout_s=self.join_timeout_s, high_priority=self.high_priority)
        return [replace(base, port=self.base_port + s if self.base_port else 0) for s in range(num_stages)]


def _ranks():
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_context_parallel_rank())


def _expert_ranks() -> tuple[int, int, int, int]:
    """(ep rank, ep size, expert-TP rank, expert-data-parallel rank)."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())


def takes_part_in_export() -> bool:
    """True on the ranks that export the shared tensors (TP-collective): DP replica 0, CP rank 0."""
    _, _, _, dp, cp = _ranks()
    return dp == 0 and cp == 0


def takes_part_in_expert_export() -> bool:
    """True on the ranks that export their EP rank's experts (collective over expert TP)."""
    return _expert_ranks()[3] == 0


def source_of(meta, ep: int) -> int:
    """The source (sending rank's group) of a `WeightMeta`: stage * ep + owning EP rank (0 if shared)."""
    return meta.pp_stage * ep + (meta.ep_rank or 0)


def my_source() -> int | None:
    """The source this rank sends, or None (at most one: a rank has one stage and one EP rank)."""
    stage, _, tp, _, _ = _ranks()
    ep_rank, ep, etp_rank, _ = _expert_ranks()
    if not takes_part_in_expert_export() or etp_rank != 0:
        return None
    # EP rank 0's sender also sends the shared tensors: it must be their exporter's TP rank 0
    if ep_rank == 0 and not (takes_part_in_export() and tp == 0):
        return None
    return stage * ep + ep_rank


def is_stage_owner() -> bool:
    """True on a rank that sends one source (a PP stage's shared tensors, or an EP rank's experts)."""
    return my_source() is not None


def _check_single_sender_of_shared(ep: int) -> None:
    """The shared tensors' sender (TP rank 0 of replica 0) must also send EP rank 0's experts."""
    _, _, tp, _, _ = _ranks()
    ep_rank, _, etp_rank, edp_rank = _expert_ranks()
    if takes_part_in_export() and tp == 0 and (ep_rank, etp_rank, edp_rank) != (0, 0, 0):
        raise RuntimeError(f"weight sync: the rank exporting the shared tensors (TP rank 0 of data-parallel "
                           f"replica 0) is EP rank {ep_rank}, expert-TP rank {etp_rank}, expert-DP rank "
                           f"{edp_rank}: expected 0, 0, 0 (Megatron rank order changed?)")


def _my_parts(meta, stage: int) -> bool:
    """True for the tensors whose export this rank takes part in (its stage, shared or own experts)."""
    if meta.pp_stage != stage:
        return False
    if meta.ep_rank is None:
        return takes_part_in_export()
    return meta.ep_rank == _expert_ranks()[0] and takes_part_in_expert_export()


class MegatronWeightExport:
    """The trainer's end of the weight sync, on every trainer rank: exports this rank's part of the
    model (TP / expert-TP gathers, or the peer export) and, on a source's sending rank, streams it
    through that source's `BucketSender`. Build once after the model exists; `bind()` and
    `connect()` once, then `sync(version)` after every optimizer step. `fresh_params` (the trainer
    engine's `MegatronEngine.fresh_params`, collective over DP) runs first in every sync: a step whose
    param all-gather is overlapped with the next forward leaves the chunks stale until it runs."""

    def __init__(self, model_chunks, cfg: SyncGroupsConfig, *,
                 fresh_params: Callable[[], None] | None = None):
        self.model_chunks, self.cfg = model_chunks, cfg
        self.fresh_params = fresh_params
        stage, num_stages, *_ = _ranks()
        self.ep = _expert_ranks()[1]
        _check_single_sender_of_shared(self.ep)
        self.metadata = hf_weight_metadata(model_chunks)
        # sources whose export this rank takes part in, in the order it walks them
        self.sources = sorted({source_of(m, self.ep) for m in self.metadata if _my_parts(m, stage)})
        # the plan's "stage" of a tensor is its source: one group and one sender per source
        self.plan = BucketPlan.from_metadata([replace(m, pp_stage=source_of(m, self.ep))
                                              for m in self.metadata],
                                             cfg.bucket_bytes, receive_order(len(self.sources)))
        self.groups = cfg.stage_groups(num_stages * self.ep)
        self.source = my_source()
        self.sender: BucketSender | None = None
        self._storages = ModelStorages(*model_chunks)  # walks the chunks only when they may have changed
        self._replay: BucketReplay | None = None  # the sender's records of its packs
        if self.source is not None:
            transport = make_transport(cfg.transport, self.groups[self.source], rank=0)
            self.sender = BucketSender(self.plan, transport, self.source)
        self.peer: PeerExport | None = None  # built at the first sync where it applies
        self._peer_checked = False
        self._check_tp_export()

    def _check_tp_export(self) -> None:
        if self.cfg.tp_export not in TP_EXPORTS:
            raise ValueError(f"tp_export: expected one of {TP_EXPORTS}, got {self.cfg.tp_export!r}")
        if self.cfg.tp_export == "peer" and self.ep > 1:
            raise ValueError(f"weight_sync.tp_export=peer: dense models only (this one has expert "
                             f"parallelism {self.ep}); use gather or auto")

    def bind(self) -> list[TransportConfig]:
        """Collective over every trainer rank: stage owners hold their group's port (moving to a free
        one if it is taken), then all ranks agree on the ports; returns `groups` for the receivers."""
        port = self.sender.transport.bind() if self.sender is not None else 0
        ports = agree_stage_ports(self.source or 0, port, len(self.groups))
        self.groups = [replace(g, port=p) for g, p in zip(self.groups, ports)]
        return self.groups

    def connect(self) -> None:
        """Stage owners join their group; rollout workers must be joining concurrently, on the ports
        of `groups` (after `bind()`, the ports actually held; without it, exactly the configured ones)."""
        if self.sender is not None:
            self.sender.transport.connect()

    def sync(self, version: int) -> SenderStats | None:
        """Export and send this rank's sources (collective over TP / expert TP); raises on every
        exporting rank on failure."""
        if self.fresh_params is not None:
            self.fresh_params()
        stage = _ranks()[0]
        if self._peer_export() is not None:
            return self._sync_peer(version)
        error: BaseException | None = None
        alone = self._exports_alone()
        if alone:
            self._arm_replay()
        for source in self.sources:
            def select(meta, source=source):
                return source_of(meta, self.ep) == source and _my_parts(meta, stage)

            # views: each tensor is copied once, into the bucket
            stream = iter_hf_weights(self.model_chunks, stages="local", select=select, views=True)
            try:
                if source == self.source and error is None:
                    self.sender.sync(stream, version)
            except Exception as err:  # noqa: BLE001  (re-raised below, after the peers are released)
                error = err
            if not alone:  # peers block in the export's gathers until the sender has walked it all
                for _ in stream:
                    pass
        _agree(error, shared=takes_part_in_export(), experts=takes_part_in_expert_export() and self.ep > 1)
        return self.sender.stats if self.sender is not None else None

    def _peer_export(self) -> PeerExport | None:
        """The peer export where it applies (a dense model's TP > 1 exporting replica, tp_export
        peer or auto, every TP rank able to map the sender's buffers); decided at the first sync."""
        from megatron.core import parallel_state as ps

        if self._peer_checked:
            return self.peer
        self._peer_checked = True
        tp = ps.get_tensor_model_parallel_world_size()
        if self.cfg.tp_export == "gather" or tp == 1 or self.ep > 1 or not takes_part_in_export():
            return None
        (source,) = self.sources
        peer = PeerExport(self.model_chunks, self.plan, source, ps.get_tensor_model_parallel_group(),
                          self._storages.current)
        buffers = self.sender.buffers() if self.sender is not None else None
        if peer.connect(buffers, required=self.cfg.tp_export == "peer"):
            self.peer = peer
        return self.peer

    def _sync_peer(self, version: int) -> SenderStats | None:
        """The peer export's sync: the sender fills its part of each bucket and seals it; the other
        TP ranks write theirs (see `peer_export.py`)."""
        error: BaseException | None = None
        try:
            self.peer.begin()
            if self.sender is None:
                self.peer.run_peer()
            else:
                self.sender.sync((), version, fill=self.peer.write, seal=self.peer.seal)
        except Exception as err:  # noqa: BLE001  (re-raised below, after the other ranks are released)
            error = err
        self.peer.seal_rest()  # the other TP ranks wait for every bucket's seal
        _agree(error, shared=True, experts=False)
        return self.sender.stats if self.sender is not None else None

    def _exports_alone(self) -> bool:
        """True where this rank's export needs no peer (TP and expert TP of size 1): then its views
        are of the parameters themselves and the sender may replay its packs without walking it."""
        from megatron.core import parallel_state as ps

        return self.sender is not None and ps.get_tensor_model_parallel_world_size() == 1 and \
            ps.get_expert_tensor_parallel_world_size() == 1

    def _arm_replay(self) -> None:
        """The sender records its packs over the model's storages (anew whenever they moved, as a
        checkpoint load that replaced parameters does), checked once the sync's header is out."""
        self.sender.replay = self._current_replay

    def _current_replay(self) -> BucketReplay:
        self._replay = replay_over(self._replay, self._storages.current(), into_model=False)
        return self._replay

    def close(self, abort: bool = False) -> None:
        """`abort`: an engine of the group died; leave without waiting for it."""
        if self.sender is not None:
            self.sender.transport.close(abort)


def receive_order(my_sources: int, group=None) -> str:
    """Collective over the trainer's ranks (`group`): "layer" where no rank takes part in the
    export of more than one source, else "source" (see the module docstring)."""
    most = torch.tensor([my_sources], dtype=torch.int64, device=current_device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    order = "layer" if most.item() <= 1 else "source"
    if order == "source":
        logger.info("weight sync: a trainer rank exports %d sources; the receivers take them one after "
                    "another", most.item())
    return order


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


def _agree(error: BaseException | None, shared: bool, experts: bool) -> None:
    """Every exporting rank learns whether a sender it exported for failed: over TP for the shared
    tensors, over expert TP for the experts (each group's ranks all take part, or none does)."""
    from megatron.core import parallel_state as ps

    failed = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=current_device())
    groups = ([ps.get_tensor_model_parallel_group()] if shared else []) + \
        ([ps.get_expert_tensor_parallel_group()] if experts else [])
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("weight sync failed on the sending rank of a source this rank exported for "
                           "(TP / expert-TP rank 0); see its log")
