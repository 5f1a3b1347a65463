"""What a teacher hands the loss: dense TP-sharded logits, or sparse top-k ids + logprobs.

Position t of a sequence scores token t+1. Padding in a top-k row is id -1 with logprob -inf
(never id 0 with logprob 0, which would mean probability 1 on token 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ID = -1
# the step metric counting top-k rows with impossible contents (`validation.invalid_topk_rows`): the
# loss adds it up without a host sync, the engine refuses the update when it is not 0
INVALID_ROWS = "teacher/invalid_rows"


class MalformedTeacherOutputError(ValueError):
    """A teacher answered with rows of the wrong shape, NaN values or impossible ids."""


@dataclass(frozen=True)
class DenseTeacher:
    """Teacher logits `[N, V_local]`, sharded over the TP group exactly like the student's."""

    logits: torch.Tensor


@dataclass(frozen=True)
class TopKTeacher:
    """Teacher top-k per position: `ids [N, K]` int64 global ids (-1 = padding), `logprobs [N, K]`."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    @property
    def valid(self) -> torch.Tensor:
        """Bool mask `[N, K]` of real (non-padding) entries."""
        return self.ids != PAD_ID


@dataclass(frozen=True)
class HiddenTeacher:
    """Teacher final-norm hidden states `[N, H_t]` and this rank's output-weight shard `[V_local, H_t]`
    (sharded like the student's output layer): exact dense teacher logits `hidden @ weight.T`, formed
    only tile by tile inside the fused LM-head loss (`opkd_mcore.losses.fused_linear`).

    `vocab_size`: ids at or past it are not the teacher's (its weight rows there are padding): they
    get probability 0 (logit -1e4), as the trainer masks materialised teacher logits. `weight` is
    None on rows a served teacher sent, until the trainer attaches its shard (`train/stages.py`)."""

    hidden: torch.Tensor
    weight: torch.Tensor | None
    vocab_size: int | None = None
