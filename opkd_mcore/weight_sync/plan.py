"""The bucket plan: where every exported tensor lives on the wire.

Computed once from the export metadata (`opkd_mcore.models.hf_weight_metadata`) and reused for
every sync, so a step moves only bucket bytes. Both ends compare the plan's digest before the first
byte moves; a mismatch is reported by naming the first tensor that differs.

Layout rules:
- buckets never mix pipeline stages, because each stage's owner sends its own buckets;
- a bucket boundary does not split a tensor group (one decoder layer, or one top-level module)
  unless the group alone is larger than a bucket: vLLM fuses q/k/v and gate/up into one parameter
  and buffers a layer's pieces until the layer is complete, so a group that spans buckets pins the
  receive buffer of an earlier bucket (those buckets are flagged `splits_group`);
- a tensor larger than a bucket goes alone;
- offsets are aligned to `ALIGN_BYTES` so that every slot can be viewed as its dtype in place.

Receive order (`receive_sequence`): "layer" takes the stages' (sources') buckets merged by the
tensor group each bucket starts with, in the export's (HF) order, so that a decoder layer whose
tensors come from several sources (an MoE layer's experts, one source per EP rank) is complete
after about one bucket per source; "source" drains the stages one after another. "layer" needs
every source's sender to depend on nothing but the receivers (see `megatron_source.py`).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

DEFAULT_BUCKET_BYTES = 1 << 30
ALIGN_BYTES = 256
RECEIVE_ORDERS = ("layer", "source")
_LAYER_GROUP = re.compile(r"^(.*?\.layers\.\d+)\.")


class PlanMismatchError(RuntimeError):
    """The two ends of a weight sync do not agree on the tensors to move."""


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place on the wire: `bucket` index and byte `offset` inside that bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pp_stage: int
    bucket: int
    offset: int
    nbytes: int

    def describe(self) -> str:
        return f"shape {self.shape} dtype {_dtype_name(self.dtype)} (pp stage {self.pp_stage})"


@dataclass(frozen=True)
class Bucket:
    """A flat byte buffer's worth of tensors from one pipeline stage."""

    index: int
    pp_stage: int
    nbytes: int
    slots: tuple[int, ...]  # indices into BucketPlan.slots
    splits_group: bool  # holds part of a tensor group that continues in another bucket


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"plan: unknown dtype {name!r}")
    return dtype


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def tensor_group(name: str) -> str:
    """The unit vLLM loads together: `model.layers.N` for decoder layers, else the owning module."""
    match = _LAYER_GROUP.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0]


def _meta_rows(metadata: Iterable) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    rows, seen = [], set()
    for i, meta in enumerate(metadata):
        for attr in ("hf_name", "shape", "dtype", "pp_stage"):
            if not hasattr(meta, attr):
                raise ValueError(f"metadata[{i}]: expected a WeightMeta with attribute {attr!r}, "
                                 f"got {type(meta).__name__}")
        if meta.hf_name in seen:
            raise ValueError(f"metadata: tensor {meta.hf_name!r} appears twice")
        if not isinstance(meta.dtype, torch.dtype):
            raise ValueError(f"metadata: tensor {meta.hf_name!r} has dtype {meta.dtype!r}, "
                             "expected a torch.dtype")
        seen.add(meta.hf_name)
        rows.append((meta.hf_name, tuple(int(d) for d in meta.shape), meta.dtype, int(meta.pp_stage)))
    return rows


class _BucketBuilder:
    """Greedy packing of one stage's tensors into buckets (see the module docstring)."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.buckets: list[list[tuple[int, int]]] = []  # per bucket: (row index, offset)
        self.split_flags: list[bool] = []
        self.used = 0

    def _open(self) -> None:
        self.buckets.append([])
        self.split_flags.append(False)
        self.used = 0

    def _place(self, row: int, nbytes: int) -> None:
        if not self.buckets or (self.used and self.used + _align(nbytes) > self.bucket_bytes):
            self._open()
        self.buckets[-1].append((row, self.used))
        self.used += _align(nbytes)

    def add_group(self, rows: list[int], sizes: list[int]) -> None:
        group_bytes = sum(_align(n) for n in sizes)
        if self.buckets and self.used and self.used + group_bytes > self.bucket_bytes:
            if group_bytes <= self.bucket_bytes:
                self._open()
        touched = set()
        for row, nbytes in zip(rows, sizes):
            self._place(row, nbytes)
            touched.add(len(self.buckets) - 1)
        if len(touched) > 1:
            for b in touched:
                self.split_flags[b] = True


class BucketPlan:
    """Names, shapes, dtypes, byte offsets and bucket boundaries of one model's export."""

    def __init__(self, slots: Sequence[TensorSlot], buckets: Sequence[Bucket], bucket_bytes: int,
                 order: str = "layer"):
        if order not in RECEIVE_ORDERS:
            raise ValueError(f"order: expected one of {RECEIVE_ORDERS}, got {order!r}")
        self.slots = tuple(slots)
        self.buckets = tuple(buckets)
        self.bucket_bytes = bucket_bytes
        self.order = order  # the receivers' order of the buckets of all stages (see the module docstring)
        self._index = {s.name: i for i, s in enumerate(self.slots)}
        self._digest: str | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata: Iterable, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      order: str = "layer") -> "BucketPlan":
        """Plan from `WeightMeta`-like records (hf_name, shape, dtype, pp_stage), in their order;
        `order`: how the receivers take the stages' buckets (`receive_sequence`)."""
        if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN_BYTES:
            raise ValueError(f"bucket_bytes: expected an int >= {ALIGN_BYTES}, got {bucket_bytes!r}")
        rows = _meta_rows(metadata)
        if not rows:
            raise ValueError("metadata: expected at least one tensor, got none")
        placed: dict[int, tuple[int, int]] = {}
        buckets: list[Bucket] = []
        for stage in sorted({r[3] for r in rows}):
            builder = _BucketBuilder(bucket_bytes)
            for group_rows in _consecutive_groups([i for i, r in enumerate(rows) if r[3] == stage], rows):
                builder.add_group(group_rows, [_nbytes(rows[i]) for i in group_rows])
            for local, entries in enumerate(builder.buckets):
                index = len(buckets)
                for row, offset in entries:
                    placed[row] = (index, offset)
                end = max(off + _align(_nbytes(rows[r])) for r, off in entries)
                buckets.append(Bucket(index, stage, end, tuple(r for r, _ in entries),
                                      builder.split_flags[local]))
        slots = [TensorSlot(name, shape, dtype, stage, *placed[i], _nbytes(rows[i]))
                 for i, (name, shape, dtype, stage) in enumerate(rows)]
        return cls(slots, buckets, bucket_bytes, order)

    @classmethod
    def from_named_tensors(cls, named: Iterable[tuple[str, torch.Tensor]],
                           bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                           pp_stage: int = 0) -> "BucketPlan":
        """Plan for a plain `(name, tensor)` stream held by one stage (HF state dicts, benchmarks)."""
        return cls.from_metadata([_Row(n, tuple(t.shape), t.dtype, pp_stage) for n, t in named], bucket_bytes)

    # ---- queries -----------------------------------------------------------------------
    def slot(self, name: str) -> TensorSlot | None:
        i = self._index.get(name)
        return None if i is None else self.slots[i]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({b.pp_stage for b in self.buckets}))

    def stage_buckets(self, stage: int) -> list[Bucket]:
        return [b for b in self.buckets if b.pp_stage == stage]

    def receive_sequence(self) -> list[Bucket]:
        """Every stage's buckets in the order the receivers take them (each stage's in its own order).
        "layer": a merge of the stages' lists, each step taking the bucket whose first tensor's group
        comes first in the export order (ties: the lower stage); "source": stage after stage."""
        if self.order == "source":
            return sorted(self.buckets, key=lambda b: (b.pp_stage, b.index))
        rank: dict[str, int] = {}
        for s in self.slots:
            rank.setdefault(tensor_group(s.name), len(rank))
        # each stage's buckets start at groups in the export order; merge keeps the lower stage first on ties
        return list(heapq.merge(*(self.stage_buckets(stage) for stage in self.stages),
                                key=lambda b: rank[tensor_group(self.slots[b.slots[0]].name)]))

    def max_bucket_nbytes(self, stage: int | None = None) -> int:
        return max(b.nbytes for b in self.buckets if stage is None or b.pp_stage == stage)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    # ---- identity ------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"bucket_bytes": self.bucket_bytes, "align": ALIGN_BYTES, "order": self.order,
                           "slots": [[s.name, list(s.shape), _dtype_name(s.dtype), s.pp_stage, s.bucket,
                                      s.offset, s.nbytes] for s in self.slots],
                           "buckets": [[b.index, b.pp_stage, b.nbytes, list(b.slots), b.splits_group]
                                       for b in self.buckets]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "BucketPlan":
        data = json.loads(text)
        if data.get("align") != ALIGN_BYTES:
            raise PlanMismatchError(f"plan: alignment {data.get('align')} differs from ours ({ALIGN_BYTES})")
        slots = [TensorSlot(n, tuple(sh), _dtype_from_name(dt), st, b, off, nb)
                 for n, sh, dt, st, b, off, nb in data["slots"]]
        buckets = [Bucket(i, st, nb, tuple(sl), bool(sp)) for i, st, nb, sl, sp in data["buckets"]]
        if data.get("order") not in RECEIVE_ORDERS:
            raise PlanMismatchError(f"plan: receive order {data.get('order')!r}, expected one of "
                                    f"{RECEIVE_ORDERS} (a sender of another version?)")
        return cls(slots, buckets, data["bucket_bytes"], data["order"])

    def digest(self) -> str:
        """sha256 of the canonical plan (hex), computed once."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.to_json().encode()).hexdigest()
        return self._digest

    def first_difference(self, other: "BucketPlan") -> str | None:
        """None when both plans are identical, else a message naming the first differing tensor."""
        for mine, theirs in zip(self.slots, other.slots):
            if mine != theirs:
                if mine.name != theirs.name:
                    return f"tensor #{self.slots.index(mine)}: {mine.name!r} here, {theirs.name!r} there"
                return f"tensor {mine.name!r}: {mine.describe()} at bucket {mine.bucket} offset " \
                       f"{mine.offset} here, {theirs.describe()} at bucket {theirs.bucket} offset " \
                       f"{theirs.offset} there"
        if len(self.slots) != len(other.slots):
            longer, which = (self, "here") if len(self.slots) > len(other.slots) else (other, "there")
            extra = longer.slots[min(len(self.slots), len(other.slots))]
            return f"tensor {extra.name!r} exists only {which}"
        if self.digest() != other.digest():
            return (f"bucket layout or receive order differs (bucket_bytes {self.bucket_bytes}, order "
                    f"{self.order!r} here; {other.bucket_bytes}, {other.order!r} there)")
        return None

    def mismatch_against(self, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> str | None:
        """None when the plan moves exactly the expected tensors, else a message naming the first bad one."""
        for s in self.slots:
            if s.name not in expected:
                return f"tensor {s.name!r} ({s.describe()}) is sent but the receiver has no such weight"
            shape, dtype = expected[s.name]
            if tuple(shape) != s.shape or dtype != s.dtype:
                return (f"tensor {s.name!r}: sender has shape {s.shape} dtype {_dtype_name(s.dtype)}, "
                        f"receiver expects shape {tuple(shape)} dtype {_dtype_name(dtype)}")
        for name, (shape, dtype) in expected.items():
            if name not in self._index:
                return f"tensor {name!r} (shape {tuple(shape)} dtype {_dtype_name(dtype)}) is expected " \
                       "by the receiver but not sent"
        return None


@dataclass(frozen=True)
class _Row:
    hf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pp_stage: int


def _nbytes(row) -> int:
    numel = 1
    for d in row[1]:
        numel *= d
    return numel * torch.empty((), dtype=row[2]).element_size()


def _consecutive_groups(indices: list[int], rows) -> list[list[int]]:
    groups: list[list[int]] = []
    last = None
    for i in indices:
        key = tensor_group(rows[i][0])
        if key != last:
            groups.append([])
            last = key
        groups[-1].append(i)
    return groups
