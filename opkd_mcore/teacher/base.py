"""The teacher interface, its errors, and the checks every backend applies to its answers.

A teacher scores token sequences: for a sequence of length L it returns L-1 rows, row t scoring
token t+1 (dense logits, or top-k ids + logprobs with padding id -1 / logprob -inf).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch

from opkd_mcore.losses.teacher_outputs import (
    PAD_ID,
    DenseTeacher,
    HiddenTeacher,
    MalformedTeacherOutputError,
    TopKTeacher,
)

TeacherOutput = TopKTeacher | DenseTeacher | HiddenTeacher


class TeacherError(RuntimeError):
    """A teacher could not produce scores (server refused, engine failed)."""


class TeacherUnavailableError(TeacherError):
    """A teacher (every replica of it) stayed unreachable; `address` says where it was expected."""

    def __init__(self, message: str, address: str):
        super().__init__(message)
        self.address = address


class SampleScorer(ABC):
    """What a step's teacher stage scores with: a single `Teacher`, or a `TeacherRouter` that picks
    a teacher per sample from the sample's per-prompt data."""

    @abstractmethod
    def score_samples(self, sequences: Sequence[Sequence[int]],
                      data: Sequence[Mapping]) -> list[TeacherOutput]:
        """One output per sequence, `len(seq) - 1` rows each; `data[i]` is sequence i's per-prompt
        data (`data_source`, the routed `teacher`), one dict per sequence."""

    def close(self) -> None:
        """Release engines, servers or connections (no-op by default)."""


class Teacher(SampleScorer):
    """A scoring backend. Implementations: VllmTeacher, RemoteVllmTeacher, MegatronTeacher,
    TransformersTeacher; TeacherRouter spreads samples over several of them."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where this teacher runs (URL, model dir): what error messages name."""

    @abstractmethod
    def score(self, sequences: Sequence[Sequence[int]]) -> list[TeacherOutput]:
        """One output per sequence, `len(seq) - 1` rows each."""

    def score_samples(self, sequences: Sequence[Sequence[int]],
                      data: Sequence[Mapping]) -> list[TeacherOutput]:
        """A single teacher scores every sample whatever its data says (routing happens above it)."""
        return self.score(sequences)


def check_sequences(sequences: Sequence[Sequence[int]], name: str = "sequences") -> list[list[int]]:
    """Copy `sequences` into int lists; ValueError naming the first bad one."""
    out = []
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"{name}[{i}]: expected at least 2 tokens (a position scores the next "
                             f"token), got {len(seq)}")
        ids = [int(t) for t in seq]
        if min(ids) < 0:
            raise ValueError(f"{name}[{i}]: token ids must be >= 0, got {min(ids)}")
        out.append(ids)
    return out


def topk_from_ranked(rows: Sequence[Sequence[tuple[int, float, int]]], k: int, *,
                     request: str, vocab_size: int | None = None) -> TopKTeacher:
    """`topk_from_flat` over per-position `(token_id, logprob, rank)` entries (rank 1 = best)."""
    entries = [e for row in rows for e in row]
    return topk_from_flat([int(e[0]) for e in entries], [float(e[1]) for e in entries],
                          [int(e[2]) for e in entries], [len(row) for row in rows], k,
                          request=request, vocab_size=vocab_size)


def topk_from_flat(ids: Sequence[int] | torch.Tensor, logprobs: Sequence[float] | torch.Tensor,
                   ranks: Sequence[int] | torch.Tensor, counts: Sequence[int], k: int, *, request: str,
                   vocab_size: int | None = None) -> TopKTeacher:
    """Build a `TopKTeacher` from flat `(token_id, logprob, rank)` entries, `counts[t]` of them for
    position t in order (as vLLM's flat logprobs hold them): one pass of tensor ops, no Python per
    entry.

    Entries ranked beyond k (vLLM adds the actual next token with its own rank) are dropped, and an
    entry repeated exactly (same id and logprob: vLLM lists that token again among the top-k) counts
    once, as its last copy. Rows are ordered by rank, then logprob, and padded with id -1 / logprob
    -inf when the vocabulary is smaller than k. Raises MalformedTeacherOutputError naming `request`
    and the first bad position on NaN, duplicate or out-of-range ids, or a row with fewer than
    min(k, vocab) entries.
    """
    counts_t = torch.as_tensor(counts, dtype=torch.int64)
    rows, width = len(counts_t), int(counts_t.max()) if len(counts_t) else 0
    row_of = torch.repeat_interleave(torch.arange(rows), counts_t)
    col_of = torch.arange(len(row_of)) - torch.repeat_interleave(counts_t.cumsum(0) - counts_t, counts_t)
    grid_ids = torch.full((rows, width), PAD_ID, dtype=torch.int64)
    grid_lp = torch.full((rows, width), -math.inf, dtype=torch.float64)
    grid_rank = torch.full((rows, width), math.inf, dtype=torch.float64)  # inf: not an entry
    grid_ids[row_of, col_of] = torch.as_tensor(ids, dtype=torch.int64)
    grid_lp[row_of, col_of] = torch.as_tensor(logprobs, dtype=torch.float64)
    grid_rank[row_of, col_of] = torch.as_tensor(ranks, dtype=torch.float64)
    grid_rank[(grid_rank > k) | _earlier_repeats(grid_ids, grid_lp)] = math.inf
    # by rank, ties by logprob (descending): two stable sorts, the minor key first
    order = torch.argsort(-grid_lp, dim=1, stable=True)
    order = order.gather(1, torch.argsort(grid_rank.gather(1, order), dim=1, stable=True))[:, :k]
    taken = grid_rank.gather(1, order).isfinite()
    top_ids = torch.where(taken, grid_ids.gather(1, order), PAD_ID)
    top_lp = torch.where(taken, grid_lp.gather(1, order), -math.inf)
    _check_topk_rows(top_ids, top_lp, taken, min(k, vocab_size) if vocab_size else k, vocab_size, request)
    ids_out = torch.full((rows, k), PAD_ID, dtype=torch.int64)
    lp_out = torch.full((rows, k), -math.inf, dtype=torch.float32)
    ids_out[:, :top_ids.shape[1]], lp_out[:, :top_lp.shape[1]] = top_ids, top_lp.float()
    return TopKTeacher(ids=ids_out, logprobs=lp_out)


def _earlier_repeats(ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """True where the same (id, logprob) comes again later in the row."""
    by_id = torch.argsort(ids, dim=1, stable=True)  # equal ids keep their order
    sid, slp = ids.gather(1, by_id), logprobs.gather(1, by_id)
    repeated = (sid[:, :-1] == sid[:, 1:]) & (slp[:, :-1] == slp[:, 1:]) & (sid[:, :-1] != PAD_ID)
    out = torch.zeros_like(ids, dtype=torch.bool)
    out.scatter_(1, by_id[:, :-1], repeated)
    return out


def _check_topk_rows(ids: torch.Tensor, logprobs: torch.Tensor, taken: torch.Tensor, want: int,
                     vocab_size: int | None, request: str) -> None:
    """The checks of `topk_from_flat`, for every row at once; the error names the first bad row."""
    count = taken.sum(1)
    sorted_ids = torch.where(taken, ids, torch.iinfo(torch.int64).max).sort(dim=1).values
    duplicate = ((sorted_ids[:, 1:] == sorted_ids[:, :-1]) & taken[:, 1:]).any(1)
    out_of_range = ((ids < 0) | (ids >= vocab_size if vocab_size else False)) & taken
    bad_value = (logprobs.isnan() | (logprobs > 1e-4)) & taken
    bad = (count < want) | duplicate | out_of_range.any(1) | bad_value.any(1)
    if not bad.any():
        return
    t = int(bad.nonzero()[0])
    where, row_ids = f"{request}, position {t}", ids[t, taken[t]].tolist()
    if count[t] < want:
        raise MalformedTeacherOutputError(f"{where}: expected {want} top-k entries, got {int(count[t])}")
    if duplicate[t]:
        raise MalformedTeacherOutputError(f"{where}: duplicate token ids {row_ids}")
    if out_of_range[t].any():
        raise MalformedTeacherOutputError(f"{where}: token ids outside [0, {vocab_size or 'V'}): {row_ids}")
    raise MalformedTeacherOutputError(
        f"{where}: logprobs must be <= 0 and not NaN, got {logprobs[t, taken[t]].tolist()}")


def check_outputs(sequences: Sequence[Sequence[int]], outputs: Sequence[TeacherOutput],
                  who: str) -> None:
    """Every sequence got one output with `len(seq) - 1` rows, no NaN; else an error naming `who`."""
    if len(outputs) != len(sequences):
        raise MalformedTeacherOutputError(
            f"{who}: expected {len(sequences)} scored sequences, got {len(outputs)}")
    for i, (seq, out) in enumerate(zip(sequences, outputs)):
        values = (out.logits if isinstance(out, DenseTeacher)
                  else out.hidden if isinstance(out, HiddenTeacher) else out.logprobs)
        if values.shape[0] != len(seq) - 1:
            raise MalformedTeacherOutputError(
                f"{who}, sequence {i}: expected {len(seq) - 1} rows, got {values.shape[0]}")
        if torch.isnan(values).any():
            raise MalformedTeacherOutputError(f"{who}, sequence {i}: NaN in teacher values")
