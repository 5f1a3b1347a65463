"""The receiving side without any inference engine: join stage groups, receive buckets, hand out views.

`BucketReceiver` is what the vLLM worker extension (`receiver.py`) and the benchmark's stand-in
receiver both use. It keeps one transport per PP stage group, the accepted plan, and two receive
buffers reused across syncs (none where the transport lends the sender's buffers: colocated).
Every stage group's header comes first; then the buckets of all stages in the plan's receive order
(`BucketPlan.receive_sequence`: merged so that a layer sent by several sources completes early),
each on its own stage's transport, receiving item i+1 overlapping the load of item i.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from opkd_mcore.platform import current_device
from opkd_mcore.weight_sync.copy_replay import BucketReplay, replay_key
from opkd_mcore.weight_sync.plan import Bucket, BucketPlan, PlanMismatchError
from opkd_mcore.weight_sync.protocol import TRAILER_BYTES, ControlChannel, SyncHeader, check_trailer
from opkd_mcore.weight_sync.transport import PendingTransfer, TransportConfig, WeightTransport, make_transport

logger = logging.getLogger(__name__)

# name -> (shape, dtype) of every weight the receiving model expects
ExpectedWeights = dict[str, tuple[tuple[int, ...], torch.dtype]]
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


@dataclass
class ReceiverStats:
    syncs: int = 0
    plan_parses: int = 0
    buffer_allocations: int = 0
    bytes_received: int = 0
    last_sync_s: float = 0.0
    # where the last sync's host time went: inside `load_fn` (the engine's load), and waiting for
    # the bytes of a bucket (transfer, trailer check)
    last_load_s: float = 0.0
    last_wait_s: float = 0.0
    last_version: int = -1
    last_replayed: int = 0  # buckets of the last sync loaded by replaying recorded copies
    last_staged: int = 0  # lent buckets of the last sync that lay on another device (see `_staged`)
    # `time.monotonic()` (one clock for every process of a host) when the last receive began and
    # ended: against the caller's clock, what reaching the engine and hearing back cost
    last_start_t: float = 0.0
    last_end_t: float = 0.0
    # `time.monotonic()` of the last sync's steps: the header's receive posted, its bytes seen by the
    # host, the header decoded, bucket 0's receive posted, the last bucket's bytes seen by the host
    # (stage 0 / the last stage): a timeline against the sender's
    last_marks: dict[str, float] = field(default_factory=dict)
    # per bucket of the last sync, in the order received: (stage, bucket index, seconds waiting for
    # its bytes, seconds in `load_fn`)
    last_buckets: list[tuple[int, int, float, float]] = field(default_factory=list)
    buffer_ptrs: list[int] = field(default_factory=list)


class BucketReceiver:
    """Receives every stage's buckets and calls `load_fn` with views of each bucket's tensors."""

    def __init__(self, expected: ExpectedWeights | None = None):
        self.expected = expected
        self.transports: list[WeightTransport] = []
        self.controls: list[ControlChannel] = []
        self.plan: BucketPlan | None = None
        self.stats = ReceiverStats()
        self._buffers: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None

    def join(self, groups: list[TransportConfig], rank: int, transport: str = "group") -> None:
        """Join one group per PP stage (in stage order), as group rank `rank` (>= 1)."""
        if rank < 1:
            raise ValueError(f"rank: receivers are group ranks >= 1, got {rank}")
        for cfg in groups:
            t = make_transport(transport, cfg, rank)
            t.connect()
            self.transports.append(t)
            self.controls.append(ControlChannel(t))

    def _accept_plan(self, control: ControlChannel, header: SyncHeader) -> BucketPlan:
        if header.plan_nbytes > 0:
            text = control.move_plan(None, header.plan_nbytes)
            plan = self.plan if self.plan is not None and self.plan.digest() == header.digest else None
            complaint = None
            if plan is None:
                plan = BucketPlan.from_json(text)
                self.stats.plan_parses += 1
                if self.expected is not None:
                    complaint = plan.mismatch_against(self.expected)
            control.agree(complaint)
            self.plan = plan
        if self.plan is None or self.plan.digest() != header.digest:
            raise PlanMismatchError(f"stage {header.stage}: sender's plan digest {header.digest[:12]} was "
                                    "never shown to this receiver")
        return self.plan

    def _ensure_buffers(self, plan: BucketPlan, transport: WeightTransport) -> None:
        nbytes = plan.max_bucket_nbytes() + TRAILER_BYTES
        if self._buffers and self._buffers[0].numel() >= nbytes:
            return
        self._buffers = [transport.alloc_buffer(nbytes) for _ in range(2)]
        self.stats.buffer_allocations += 2
        self.stats.buffer_ptrs = [b.data_ptr() for b in self._buffers]

    def receive(self, load_fn: LoadFn, replay: BucketReplay | Callable[[], BucketReplay] | None = None,
                loads_in_place: bool = False) -> int:
        """Receive one full sync from every stage group; returns the weight version it carried.
        `replay`: replays each bucket's first load as plain copies where that load was one; or a
        function making it, called once the first bucket's receive is posted, so that its host work
        (a vLLM worker checks that the engine's tensors have not moved) overlaps that transfer.
        `loads_in_place`: `load_fn` keeps no view it gets past its return (it copies every tensor,
        as vLLM's direct load does, or copies what it holds on to, as the layerwise load does), so
        a bucket that splits a tensor group is handed out as views, not copies (which a replay
        could not stand in for: a copy from a temporary)."""
        if not self.transports:
            raise RuntimeError("receiver: call join() before receive()")
        start = time.perf_counter()
        self.stats.last_start_t = time.monotonic()
        self.stats.last_load_s = self.stats.last_wait_s = 0.0
        self.stats.last_replayed = self.stats.last_staged = 0
        self.stats.last_marks, self.stats.last_buckets = {}, []
        replay_now = functools.cache(replay) if callable(replay) else lambda: replay  # made once
        plan, stages = self._receive_headers()
        versions = {h.version for _, h in stages.values()}
        if len(versions) != 1:
            raise RuntimeError(f"weight sync: stage groups sent different versions {sorted(versions)}")
        self._receive_buckets(plan, stages, replay_now,
                              lambda bucket, buf: load_fn(self.views(plan, bucket, buf, not loads_in_place)))
        self.stats.syncs += 1
        self.stats.last_version = versions.pop()
        self.stats.last_sync_s = time.perf_counter() - start
        self.stats.last_end_t = time.monotonic()
        return self.stats.last_version

    def _receive_headers(self) -> tuple[BucketPlan, dict[int, tuple[WeightTransport, SyncHeader]]]:
        """Every joined stage group's header (and plan handshake), in the order joined: stage ->
        (its transport, its header)."""
        marks, stages = self.stats.last_marks, {}
        for transport, control in zip(self.transports, self.controls):
            header = control.recv_header(marks)
            marks.setdefault("header", time.monotonic())
            plan = self._accept_plan(control, header)
            where = f"stage group {transport.cfg.host}:{transport.cfg.port}"
            if header.stage in stages or header.stage not in plan.stages:
                raise PlanMismatchError(f"{where}: header of stage {header.stage}, expected one of the "
                                        f"plan's stages {plan.stages} not yet received")
            if len(plan.stage_buckets(header.stage)) != header.num_buckets:
                raise PlanMismatchError(f"stage {header.stage}: header announces {header.num_buckets} "
                                        f"buckets, plan has {len(plan.stage_buckets(header.stage))}")
            stages[header.stage] = (transport, header)
        return plan, stages

    def _receive_buckets(self, plan: BucketPlan, stages: dict[int, tuple[WeightTransport, SyncHeader]],
                         replay_now: Callable[[], BucketReplay | None],
                         load_bucket: Callable[[Bucket, torch.Tensor], None]) -> None:
        """The joined stages' buckets in the plan's receive order (`BucketPlan.receive_sequence`),
        each on its stage's transport (whose transfers stay in order): receiving item i+1, into the
        buffer item i-1 used, overlaps loading item i."""
        marks = self.stats.last_marks
        sequence = [b for b in plan.receive_sequence() if b.pp_stage in stages]
        if not sequence:  # the joined stages own no tensors: nothing to receive
            return
        transports = [stages[b.pp_stage][0] for b in sequence]
        if not all(t.lends_buffers for t in self.transports):
            self._ensure_buffers(plan, self.transports[0])
        pending = self._post(transports[0], sequence[0], 0)
        marks.setdefault("posted", time.monotonic())
        replay = replay_now()
        for i, bucket in enumerate(sequence):
            t0 = time.perf_counter()
            timeout = transports[i].cfg.timeout_s
            pending.wait(timeout)
            current = pending
            buf = current.landed if current.landed is not None else self._buffers[i % 2]
            if i + 1 < len(sequence):  # the other buffer's bucket is fully loaded by now
                pending = self._post(transports[i + 1], sequence[i + 1], i + 1)
            # checked after posting the next receive: the check waits for the bytes on the host
            # (polling, where the transfer itself does not block it: see `wait_host`)
            current.wait_host(timeout)
            version = stages[bucket.pp_stage][1].version
            check_trailer(buf, bucket.nbytes, version, bucket.index, plan.digest())
            marks["bytes_in"] = time.monotonic()
            t1 = time.perf_counter()
            home = current_device(transports[i].cfg.device)
            if current.landed is not None and buf.device != home:
                buf = self._staged(buf, bucket.nbytes + TRAILER_BYTES, home)
                current.release()  # the staged copy has been made: the sender may refill its buffer
            if replay is None:
                load_bucket(bucket, buf)
            else:
                key = replay_key(plan.digest(), bucket.index, buf)
                self.stats.last_replayed += replay.run(key, buf, lambda: load_bucket(bucket, buf))
            if buf is not self._staging:
                current.release()  # a lent buffer goes back to the sender once the load has read it
            t2 = time.perf_counter()
            self.stats.last_wait_s += t1 - t0
            self.stats.last_load_s += t2 - t1
            self.stats.last_buckets.append((bucket.pp_stage, bucket.index, t1 - t0, t2 - t1))
            self.stats.bytes_received += bucket.nbytes

    def _staged(self, lent: torch.Tensor, nbytes: int, home: torch.device) -> torch.Tensor:
        """A bucket lent from another device (an EP rank's beside the engine's, by device IPC), copied
        whole into this device's staging buffer. Read in place, every tensor of it would cross the link
        in a copy of its own (~100 us of host time each: 3072 for 8 layers of 128 experts) and the
        loaders' cross-device copies would not be recorded for replay; one copy of the bucket runs on
        the copy engine at the link's rate, and the load reads local memory. One buffer serves every
        such bucket: the next copy into it queues behind this load's reads on the same stream."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=lent.dtype, device=home)
            self.stats.buffer_allocations += 1
        self._staging[:nbytes].copy_(lent[:nbytes])
        self.stats.last_staged += 1
        return self._staging

    def _post(self, transport: WeightTransport, bucket: Bucket, i: int) -> PendingTransfer:
        """The transfer of `bucket`, item i of the sequence, on its stage's transport: read in place
        where the transport lends the sender's buffers (one copy fewer), else into receive buffer
        i % 2."""
        nbytes = bucket.nbytes + TRAILER_BYTES
        if transport.lends_buffers:
            return transport.receive_lent(nbytes)
        return transport.broadcast(self._buffers[i % 2], nbytes)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers `load_fn` gets views into (its own, or those lent by the senders), valid until
        the next bucket lands."""
        return list(self._buffers) + [b for t in self.transports for b in t.lent_buffers()]

    @staticmethod
    def views(plan: BucketPlan, bucket: Bucket, buf: torch.Tensor,
              copy_split: bool = True) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into `buf`; copies when the bucket splits a group (see plan.py) and
        `copy_split`."""
        out = []
        for i in bucket.slots:
            s = plan.slots[i]
            view = buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
            out.append((s.name, view.clone() if copy_split and bucket.splits_group else view))
        return out

    def close(self, abort: bool = False) -> None:
        """Leave every stage group; `abort` when a member is gone (see `WeightTransport.close`)."""
        for t in self.transports:
            t.close(abort)
        self.transports, self.controls = [], []
