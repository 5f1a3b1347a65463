"""The teacher interface, its errors, and the checks every backend applies to its answers.

A teacher scores token sequences: for a sequence of length L it returns L-1 rows, row t scoring
token t+1 (dense logits, or top-k ids + logprobs with padding id -1 / logprob -inf).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, HiddenTeacher, TopKTeacher

TeacherOutput = TopKTeacher | DenseTeacher | HiddenTeacher


class TeacherError(RuntimeError):
    """A teacher could not produce scores (server refused, engine failed)."""


class TeacherUnavailableError(TeacherError):
    """A teacher (every replica of it) stayed unreachable; `address` says where it was expected."""

    def __init__(self, message: str, address: str):
        super().__init__(message)
        self.address = address


class MalformedTeacherOutputError(ValueError):
    """A teacher answered with rows of the wrong shape, NaN values or impossible ids."""


class Teacher(ABC):
    """A scoring backend. Implementations: VllmTeacher, RemoteVllmTeacher, MegatronTeacher,
    TransformersTeacher; TeacherRouter spreads samples over several of them."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where this teacher runs (URL, model dir): what error messages name."""

    @abstractmethod
    def score(self, sequences: Sequence[Sequence[int]]) -> list[TeacherOutput]:
        """One output per sequence, `len(seq) - 1` rows each."""

    def close(self) -> None:
        """Release engines, servers or connections (no-op by default)."""


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
    """Build a `TopKTeacher` from per-position `(token_id, logprob, rank)` entries (rank 1 = best).

    Entries ranked beyond k (vLLM adds the actual next token with its own rank) are dropped; rows
    are ordered by rank and padded with id -1 / logprob -inf when the vocabulary is smaller than k.
    Raises MalformedTeacherOutputError naming `request` and the position on NaN, duplicate or
    out-of-range ids, or a row with fewer than min(k, vocab) entries.
    """
    want = min(k, vocab_size) if vocab_size else k
    ids = torch.full((len(rows), k), PAD_ID, dtype=torch.int64)
    logprobs = torch.full((len(rows), k), -math.inf, dtype=torch.float32)
    for t, entries in enumerate(rows):
        top = sorted((e for e in entries if e[2] <= k), key=lambda e: (e[2], -e[1]))[:k]
        where = f"{request}, position {t}"
        if len(top) < want:
            raise MalformedTeacherOutputError(
                f"{where}: expected {want} top-k entries, got {len(top)}")
        row_ids = [int(e[0]) for e in top]
        if len(set(row_ids)) != len(row_ids):
            raise MalformedTeacherOutputError(f"{where}: duplicate token ids {row_ids}")
        if min(row_ids) < 0 or (vocab_size and max(row_ids) >= vocab_size):
            raise MalformedTeacherOutputError(
                f"{where}: token ids outside [0, {vocab_size or 'V'}): {row_ids}")
        values = [float(e[1]) for e in top]
        if any(math.isnan(v) or v > 1e-4 for v in values):
            raise MalformedTeacherOutputError(f"{where}: logprobs must be <= 0 and not NaN, got {values}")
        ids[t, :len(top)] = torch.tensor(row_ids, dtype=torch.int64)
        logprobs[t, :len(top)] = torch.tensor(values, dtype=torch.float32)
    return TopKTeacher(ids=ids, logprobs=logprobs)


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
