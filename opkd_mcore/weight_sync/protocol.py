"""What travels besides bucket bytes: the per-sync header, the plan handshake, the bucket trailer.

Per sync and stage group: a fixed-size header (magic, weight version, stage, number of buckets, plan
length, plan digest). When the sender has not yet shown this plan to this group, the serialized plan
follows and every member reports whether it accepts it (a receiver checks it against the weights its
model expects); any complaint fails every member with the message naming the tensor. Every bucket
carries a trailer with the version, its index and the digest prefix, so a receiver can never load
bytes of another version or another bucket without noticing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from opkd_mcore.weight_sync.plan import BucketPlan, PlanMismatchError
from opkd_mcore.weight_sync.transport import PendingTransfer, WeightTransport

HEADER_MAGIC = 0x6F706B6468647231  # "opkdhdr1"
TRAILER_MAGIC = 0x6F706B6474726C31  # "opkdtrl1"
HEADER_WORDS = 9
TRAILER_WORDS = 4
TRAILER_BYTES = TRAILER_WORDS * 8


def _digest_words(digest_hex: str) -> list[int]:
    raw = bytes.fromhex(digest_hex)
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _words_digest(words: list[int]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).hex()


@dataclass(frozen=True)
class SyncHeader:
    version: int
    stage: int
    num_buckets: int
    plan_nbytes: int  # > 0: the serialized plan follows
    digest: str

    def encode(self) -> list[int]:
        return [HEADER_MAGIC, self.version, self.stage, self.num_buckets, self.plan_nbytes,
                *_digest_words(self.digest)]

    @classmethod
    def decode(cls, words: list[int]) -> "SyncHeader":
        if words[0] != HEADER_MAGIC:
            raise RuntimeError(f"weight sync: bad header magic {words[0]:#x}; sender and receiver "
                               "are out of step (a previous sync was interrupted?)")
        return cls(words[1], words[2], words[3], words[4], _words_digest(words[5:9]))


class ControlChannel:
    """Small fixed buffers for headers and the plan, allocated once per transport."""

    def __init__(self, transport: WeightTransport):
        self.transport = transport
        self.header_buf = transport.alloc_buffer(HEADER_WORDS * 8)
        self.handshaken_digest: str | None = None

    def _timeout(self) -> float:
        return self.transport.cfg.timeout_s

    def post_header(self, header: SyncHeader) -> PendingTransfer:
        """The header's transfer, not waited for. Its bytes go from host memory in a copy that
        does not wait for the device's queue (a blocking one would wait for all work queued
        before it); the buffer is next written by the next sync, queued after this one's buckets."""
        words = torch.tensor(header.encode(), dtype=torch.int64).view(torch.uint8)
        self.header_buf.copy_(words, non_blocking=True)
        return self.transport.broadcast(self.header_buf, self.header_buf.numel())

    def recv_header(self, marks: dict[str, float] | None = None) -> SyncHeader:
        """The sender's header; `marks` gets (`time.monotonic()`) `header_asked`, once its receive is
        posted, and `header_landed`, when the host saw its bytes arrive, before reading them."""
        marks = {} if marks is None else marks
        pending = self.transport.broadcast(self.header_buf, self.header_buf.numel())
        marks.setdefault("header_asked", time.monotonic())
        pending.wait_for_host(self._timeout())
        marks.setdefault("header_landed", time.monotonic())
        return SyncHeader.decode(self.header_buf.cpu().view(torch.int64).tolist())

    def move_plan(self, plan_json: str | None, nbytes: int) -> str:
        """Sender passes its plan's JSON; receivers pass None and get it back."""
        buf = self.transport.alloc_buffer(nbytes)
        if plan_json is not None:
            buf.copy_(torch.frombuffer(bytearray(plan_json.encode()), dtype=torch.uint8))
        self.transport.broadcast(buf, nbytes).wait_for_host(self._timeout())
        return buf.cpu().numpy().tobytes().decode()

    def agree(self, complaint: str | None) -> None:
        """Every member states its complaint (None = accepts); raises PlanMismatchError on any."""
        complaints = self.transport.exchange_status(complaint or "")
        for rank, text in enumerate(complaints):
            if text:
                role = "sender" if rank == 0 else f"receiver rank {rank}"
                raise PlanMismatchError(f"weight-sync plan check failed at {role}: {text}")


def trailers(buckets: list[int], version: int, digest: str, device: torch.device) -> torch.Tensor:
    """The trailers of one sync's buckets, `[len(buckets), TRAILER_BYTES]` bytes on `device`, moved
    there in one copy that does not wait: copied from host memory one bucket at a time, each
    trailer made the sender's host wait for its stream (a blocking copy from pageable memory),
    i.e. for the broadcasts queued before it."""
    digest_word = _digest_words(digest)[0]
    words = torch.tensor([[TRAILER_MAGIC, version, b, digest_word] for b in buckets], dtype=torch.int64)
    return words.view(torch.uint8).to(device, non_blocking=True)


def check_trailer(buf: torch.Tensor, at: int, version: int, bucket: int, digest: str) -> None:
    words = buf[at:at + TRAILER_BYTES].cpu().view(torch.int64).tolist()
    expected = [TRAILER_MAGIC, version, bucket, _digest_words(digest)[0]]
    if words != expected:
        raise RuntimeError(f"weight sync: bucket {bucket} arrived with trailer (magic, version, bucket, "
                           f"digest) = {words}, expected {expected}")


def plan_header(plan: BucketPlan, version: int, stage: int, send_plan: bool) -> tuple[SyncHeader, str | None]:
    text = plan.to_json() if send_plan else None
    nbytes = len(text.encode()) if text is not None else 0
    return SyncHeader(version, stage, len(plan.stage_buckets(stage)), nbytes, plan.digest()), text
