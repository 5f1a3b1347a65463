"""The sending side of the bucket stream: one per source (pipeline stage), run by its owner rank.

`BucketSender(plan, transport, stage).sync(named_tensors, version)` walks the export stream of its
stage, packs tensors into one of two reused flat buffers and broadcasts it. Packing bucket i+1
overlaps the transfer of bucket i, and a rank never holds more than two buckets. The sender only
reads the trainer's tensors: a failed sync leaves the trainer's weights untouched.
"""
from __future__ import annotations

import itertools
import logging
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from opkd_mcore.weight_sync.copy_replay import BucketReplay, replay_key
from opkd_mcore.weight_sync.plan import Bucket, BucketPlan, TensorSlot
from opkd_mcore.weight_sync.protocol import TRAILER_BYTES, ControlChannel, plan_header, trailers
from opkd_mcore.weight_sync.transport import PendingTransfer, WeightTransport

logger = logging.getLogger(__name__)


@dataclass
class SenderStats:
    """Counters that let callers (and tests) see what a sync did."""

    syncs: int = 0
    handshakes: int = 0  # times the plan was shown to the group (once per connected transport)
    buffer_allocations: int = 0
    bytes_sent: int = 0
    last_sync_s: float = 0.0
    # where the last sync's host time went: pulling tensors from the export stream into a bucket
    # (TP gathers, un-fusing: the export's cost), and waiting for the previous bucket's transfer
    last_pack_s: float = 0.0
    last_wait_s: float = 0.0
    last_replayed: int = 0  # buckets of the last sync packed by replaying recorded copies
    # `time.monotonic()` of the last sync's steps: its start, the header's post asked for and done
    # (before bucket 0 is packed, or after where posting waits), bucket 0 packed, the header (and
    # plan) waited for, the last bucket's transfer posted, its end: a timeline against the receivers'
    last_marks: dict[str, float] = field(default_factory=dict)
    buffer_ptrs: list[int] = field(default_factory=list)


class BucketSender:
    """Packs one source's tensors (a PP stage's, or an EP rank's experts) into buckets and streams
    them through a connected transport (group rank 0); the receiving end is `BucketReceiver`."""

    def __init__(self, plan: BucketPlan, transport: WeightTransport, stage: int = 0):
        """`replay` (set later by the caller, `None` = off): a `BucketReplay` over the storages of
        the tensors the stream hands out, or a function making it (called once the sync's header
        is out); once every bucket's pack was recorded as pure copies, a sync replays them and
        does not walk the stream at all (the stream must then be lazy and free of collectives)."""
        if stage not in plan.stages:
            raise ValueError(f"stage: plan has stages {plan.stages}, got {stage}")
        if not transport.is_sender:
            raise ValueError(f"transport: the sender must be group rank 0, got rank {transport.rank}")
        self.plan, self.transport, self.stage = plan, transport, stage
        self.buckets = plan.stage_buckets(stage)
        self.stats = SenderStats()
        self._control: ControlChannel | None = None
        self._buffers: list[torch.Tensor] = []
        self.replay: BucketReplay | Callable[[], BucketReplay] | None = None

    def _ensure_ready(self) -> ControlChannel:
        if self._control is None:
            self.transport.connect()
            self._control = ControlChannel(self.transport)
        self.buffers()
        return self._control

    def buffers(self) -> list[torch.Tensor]:
        """The two bucket buffers (allocated on first use, then reused): bucket i goes in i % 2."""
        if not self._buffers:
            nbytes = self.plan.max_bucket_nbytes(self.stage) + TRAILER_BYTES
            self._buffers = [self.transport.alloc_buffer(nbytes) for _ in range(2)]
            self.stats.buffer_allocations += 2
            self.stats.buffer_ptrs = [b.data_ptr() for b in self._buffers]
        return self._buffers

    def _post_header(self, control: ControlChannel, version: int) -> tuple[PendingTransfer, str | None]:
        """The header's transfer (not waited for), and the plan's text where the plan follows it."""
        first = control.handshaken_digest != self.plan.digest()
        header, text = plan_header(self.plan, version, self.stage, send_plan=first)
        self.stats.last_marks["header_asked"] = time.monotonic()
        posted = control.post_header(header)
        self.stats.last_marks["header_posted"] = time.monotonic()
        return posted, text

    def _finish_handshake(self, control: ControlChannel, posted: tuple[PendingTransfer, str | None]) -> None:
        """After the header: the plan and every member's verdict on it, where the plan was sent."""
        header, text = posted
        header.wait(self.transport.cfg.timeout_s)  # before any other transfer: some acknowledge each
        if text is not None:
            control.move_plan(text, len(text.encode()))
            control.agree(None)
            control.handshaken_digest = self.plan.digest()
            self.stats.handshakes += 1

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
             fill: Callable[[int, torch.Tensor], None] | None = None,
             seal: Callable[[], None] | None = None) -> SenderStats:
        """Send every tensor of this stage, stamped with `version`; returns the updated stats.

        `fill(i, buffer)` packs bucket i in place of the stream (whose tensors then go unread), and
        `seal()` runs before each bucket is sent, once the buffer of the bucket before it is free
        again: the peer export (`peer_export.py`) writes the other TP ranks' shards in between."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version: expected a non-negative int, got {version!r}")
        start = time.perf_counter()
        marks = self.stats.last_marks = {"start": time.monotonic()}
        control = self._ensure_ready()
        stream = iter(named_tensors)
        timeout = self.transport.cfg.timeout_s
        pending: PendingTransfer | None = None
        pack_s, replay, tails = self._begin(control, version, stream, fill)
        wait_s = 0.0
        for i, bucket in enumerate(self.buckets):
            if i > 0:  # overlaps the transfer of bucket i-1
                pack_s += self._pack_bucket(i, stream, tails, replay, fill)
            t1 = time.perf_counter()
            if pending is not None:
                pending.wait(timeout)
            wait_s += time.perf_counter() - t1
            if seal is not None:
                seal()
            pending = self.transport.broadcast(self._buffers[i % 2], bucket.nbytes + TRAILER_BYTES)
            self.stats.bytes_sent += bucket.nbytes
        marks["posted_last"], t1 = time.monotonic(), time.perf_counter()
        if pending is not None:
            pending.wait(timeout)
        self.stats.last_pack_s, self.stats.last_wait_s = pack_s, wait_s + time.perf_counter() - t1
        leftover = None if replay[1] or fill is not None else next(stream, None)
        if leftover is not None:
            raise ValueError(f"named_tensors: tensor {leftover[0]!r} is not in stage {self.stage}'s plan "
                             "(stream longer than the plan)")
        self.stats.syncs += 1
        self.stats.last_sync_s = time.perf_counter() - start
        marks["end"] = time.monotonic()
        logger.info("weight sync v%d stage %d: %d buckets, %.1f MB in %.3f s", version, self.stage,
                    len(self.buckets), self.stats.bytes_sent / self.stats.syncs / 1e6, self.stats.last_sync_s)
        return self.stats

    def _begin(self, control: ControlChannel, version: int, stream: Iterator[tuple[str, torch.Tensor]],
               fill: Callable[[int, torch.Tensor], None] | None) -> tuple[float, tuple, torch.Tensor]:
        """The header (and the plan, where it must move) out and bucket 0 packed; returns the host
        seconds packing, (the replay, every bucket replayable), and every bucket's trailer."""
        # The header goes out first and is waited for after bucket 0 is packed: the receivers, who
        # wait for it before they post any bucket's receive, get it as soon as they ask, and
        # packing bucket 0 overlaps that wait (on accelerators, the work queued after a waited
        # transfer waits for it, and so for the receivers to arrive). Where posting it already
        # waits for them, bucket 0 is packed first instead.
        posted = None if self.transport.broadcast_waits else self._post_header(control, version)
        replay = self.replay() if callable(self.replay) else self.replay
        replaying = replay is not None and all(replay.replayable(self._key(i))
                                               for i in range(len(self.buckets)))
        self.stats.last_replayed = 0
        tails = trailers([b.index for b in self.buckets], version, self.plan.digest(),
                         self._buffers[0].device)
        pack_s = self._pack_bucket(0, stream, tails, (replay, replaying), fill) if self.buckets else 0.0
        self.stats.last_marks["packed"] = time.monotonic()
        self._finish_handshake(control, posted or self._post_header(control, version))
        self.stats.last_marks["handshaken"] = time.monotonic()
        return pack_s, (replay, replaying), tails

    def _pack_bucket(self, i: int, stream: Iterator[tuple[str, torch.Tensor]], tails: torch.Tensor,
                     replay: tuple[BucketReplay | None, bool],
                     fill: Callable[[int, torch.Tensor], None] | None) -> float:
        """Bucket i into its buffer (packed, filled, or replayed where `replay` = (the replay, every
        bucket replayable)), then its trailer (row i of `tails`); returns host seconds."""
        start, bucket, buf = time.perf_counter(), self.buckets[i], self._buffers[i % 2]
        pack = (lambda: fill(i, buf)) if fill is not None else (lambda: self._pack(bucket, buf, stream))
        records, replaying = replay
        if records is None:
            pack()
        else:
            # all or none: a replayed bucket would leave its tensors unread in the stream
            self.stats.last_replayed += records.run(self._key(i), buf, pack, may_replay=replaying)
        buf[bucket.nbytes:bucket.nbytes + TRAILER_BYTES].copy_(tails[i])
        return time.perf_counter() - start

    def _key(self, i: int) -> tuple:
        return replay_key(self.plan.digest(), self.buckets[i].index, self._buffers[i % 2])

    def _pack(self, bucket: Bucket, buf: torch.Tensor, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        missing = {self.plan.slots[i].name for i in bucket.slots}
        while missing:
            item = next(stream, None)
            if item is None:
                raise ValueError(f"named_tensors: stream ended before tensor {sorted(missing)[0]!r} "
                                 f"(bucket {bucket.index}, stage {self.stage})")
            name, tensor = item
            slot = self.plan.slot(name)
            if slot is None or name not in missing:
                where = "is not in the plan" if slot is None else \
                    f"belongs to bucket {slot.bucket} (stage {slot.pp_stage}), expected one of bucket " \
                    f"{bucket.index}: {sorted(missing)[:3]}"
                raise ValueError(f"named_tensors: tensor {name!r} {where}")
            _check_tensor(slot, tensor)
            buf[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(tensor.shape).copy_(tensor)
            missing.discard(name)


def refines(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True when `shape` is `target` with dimensions split (each of `target`'s is a product of
    adjacent ones of `shape`): the same elements in the same row-major order, so the tensor copies
    into a `target`-shaped buffer through `.view(shape)`."""
    return set(itertools.accumulate(target, operator.mul)) <= set(itertools.accumulate(shape, operator.mul)) \
        and math.prod(shape) == math.prod(target)


def _check_tensor(slot: TensorSlot, tensor: torch.Tensor) -> None:
    """The plan's shape, or one that refines it (as a view export hands out q/k/v, gate/up and
    gathered row-parallel weights)."""
    shape = tuple(tensor.shape)
    if not refines(shape, tuple(slot.shape)) or tensor.dtype != slot.dtype:
        raise ValueError(f"named_tensors: tensor {slot.name!r} has shape {shape} dtype "
                         f"{tensor.dtype}, the plan says {slot.describe()}")
