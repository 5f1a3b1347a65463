"""Peer export: every TP rank writes its own shards straight into the sending rank's buckets.

At TP > 1 the export used to all-gather each parameter to the sending rank, which then copied the
gathered tensor into a bucket: the sender's device moved every byte three times (its own shard into
the gather, the peers' shards in, the whole into the bucket), and where a vLLM engine shares that
device those kernels took turns with the engine's load. Here the sender exports its two bucket
buffers once as IPC handles, every other TP rank of the stage maps them on its own device (peer
access: the bytes stay on the sender's device) and copies its part of each tensor into place
(`models.shard_writes`), so every byte is written once, by the device that holds its shard.

One all-reduce over the TP group per bucket orders the writes (`seal`). A peer writes bucket i after
the seal of bucket i-1, which the sender runs only once the receivers have acknowledged bucket i-2
(whose buffer bucket i reuses); the sender sends bucket i after its seal, i.e. after every peer's
writes of it (stream order on each device). The sender runs every seal even when its sync fails,
so the peers never wait for a bucket that is not coming.

Needs the TP ranks of a stage on one host with peer access between their devices (or CPU shared
memory). `tp_export: auto` uses it where every rank could map the buffers and all-gathers
otherwise (logged); `peer` makes a rank that cannot map them an error.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from opkd_mcore.models import shard_writes
from opkd_mcore.platform import current_device
from opkd_mcore.platform.ipc_handles import (
    decode_handles,
    encode_handles,
    export_ipc_handles,
    open_ipc_handle,
)
from opkd_mcore.weight_sync.plan import BucketPlan

logger = logging.getLogger(__name__)

TP_EXPORTS = ("auto", "gather", "peer")


class PeerExport:
    """One PP stage's peer export; built on every TP rank of the stage's exporting replica."""

    def __init__(self, model_chunks, plan: BucketPlan, source: int, group,
                 storages: Callable[[], set[int]]):
        """`storages()`: the model's storage set, a new object whenever the parameters moved (then
        the cached copy lists are made again)."""
        self.model_chunks, self.plan, self.group, self.storages = model_chunks, plan, group, storages
        self.buckets = plan.stage_buckets(source)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.mapped: list[torch.Tensor] = []  # TP ranks > 0: the sender's two buffers
        self._flag = torch.zeros(1, dtype=torch.int32, device=current_device())
        self._pairs: dict[tuple[int, int], list] = {}
        self._pairs_for: set[int] | None = None
        self.sealed = 0  # seals of the sync in progress

    def connect(self, buffers: list[torch.Tensor] | None, required: bool) -> bool:
        """Collective over the TP group: the sender (TP rank 0) passes its bucket buffers, the others
        None and map them. Returns whether every rank could; raises if `required` and one could not."""
        reason = ""
        words, raw = self._share(buffers)
        if self.rank > 0:
            what, peers = "the bucket buffers of the weight-sync sender (TP rank 0)", self.size - 1
            try:  # per buffer, one handle per peer
                handles = decode_handles(words, raw, what)
                self.mapped = [open_ipc_handle(handles[b * peers + self.rank - 1], f"{what}, buffer {b}",
                                               peer=True) for b in range(2)]
            except (ValueError, RuntimeError) as err:  # IpcHandleError is a ValueError
                reason = str(err)
        failed = torch.tensor([1 if reason else 0], dtype=torch.int32, device=current_device())
        everyone = [torch.zeros_like(failed) for _ in range(self.size)]
        dist.all_gather(everyone, failed, group=self.group)
        bad = [r for r, f in enumerate(torch.cat(everyone).tolist()) if f]
        if reason:
            logger.warning("weight sync: TP rank %d cannot map the sender's buckets: %s", self.rank, reason)
        if bad and required:
            raise RuntimeError(f"weight_sync.tp_export=peer: TP rank(s) {bad} could not map the sending "
                               "rank's bucket buffers (TP ranks on other hosts, or devices without peer "
                               "access; each rank's log says why); use tp_export=gather or auto")
        if bad:
            logger.info("weight sync: TP rank(s) %s cannot map the sender's buckets; all-gathering instead",
                        bad)
            self.mapped = []
        return not bad

    def _share(self, buffers: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's handles of its `buffers` (per buffer, one per peer) to every TP rank in one
        message: its sizes, then the encoded words and bytes."""
        device, root = current_device(), dist.get_global_rank(self.group, 0)
        encoded = (None, None)
        if buffers is not None:
            encoded = encode_handles([h for b in buffers for h in export_ipc_handles(b, self.size - 1)])
        sizes = torch.tensor([0 if t is None else t.numel() for t in encoded], device=device)
        dist.broadcast(sizes, src=root, group=self.group)
        moved = []
        for t, n, dtype in zip(encoded, sizes.tolist(), (torch.int64, torch.uint8)):
            on_device = t.to(device) if t is not None else torch.empty(n, dtype=dtype, device=device)
            if n:
                dist.broadcast(on_device, src=root, group=self.group)
            moved.append(on_device.cpu())
        return moved[0], moved[1]

    def begin(self) -> None:
        """Once per sync, before the first `write`: drop the copy lists if the parameters moved
        (their views of the old tensors would be stale)."""
        self.sealed = 0
        storages = self.storages()
        if storages is not self._pairs_for:
            self._pairs, self._pairs_for = {}, storages

    def write(self, i: int, buf: torch.Tensor) -> None:
        """Copy this rank's part of bucket i's tensors into `buf` (the sender's buffer i % 2)."""
        for dst, src in self._pairs_of(i, buf):
            dst.copy_(src)

    def _pairs_of(self, i: int, buf: torch.Tensor) -> list:
        key = (i, buf.data_ptr())
        if key not in self._pairs:
            slots = [self.plan.slots[j] for j in self.buckets[i].slots]
            named = [(s.name, buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in slots]
            self._pairs[key] = shard_writes(self.model_chunks, named)
        return self._pairs[key]

    def seal(self) -> None:
        """The TP all-reduce that orders one bucket's writes (see the module docstring)."""
        dist.all_reduce(self._flag, group=self.group)
        self.sealed += 1

    def seal_rest(self) -> None:
        """After a sync, failed or not: the seals this rank has not run, so no other rank waits
        for a bucket that is not coming."""
        while self.sealed < len(self.buckets):
            self.seal()

    def run_peer(self) -> None:
        """A TP rank > 0's part of one sync (after `begin`): write every bucket, each after the seal
        before it."""
        for i in range(len(self.buckets)):
            self.write(i, self.mapped[i % 2])
            self.seal()
