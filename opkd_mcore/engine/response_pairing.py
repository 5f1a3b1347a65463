"""Pairs the student's rows with the teacher's when the teacher scored the response after its own prompt.

Row t of a scored sequence scores token t+1. The student's sequence is `P_s` prompt tokens and then
R response tokens; the teacher's (privileged context, `data/teacher_prompts.py`) is `P_t` prompt
tokens and then the same R tokens. Student row `P_s - 1 + j`, which predicts response token j, pairs
with teacher row `P_t - 1 + j`, which predicts the same token after the teacher's prompt. The other
student rows predict prompt tokens (or nothing: a sequence's last position) and are never scored
(loss_mask 0): they get padding rows, as a teacher marks a row it has no values for (top-k: id -1 and
logprob -inf; dense logits and hidden states: zeros, finite so that a masked row's loss stays 0).

One index per student row says which teacher row it takes (-1: padding), and `gather_rows` applies
it to any teacher output, so a scoring teacher's rows (top-k, dense logits, hidden states) and an
in-step teacher's hidden states of a packed micro-batch are paired by the same function.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, HiddenTeacher, TopKTeacher

NO_ROW = -1  # a student row without a teacher row (it predicts a prompt token, or nothing)


def response_row_index(student_prompt_len: int, teacher_prompt_len: int, response_len: int) -> torch.Tensor:
    """int64 `[P_s + R - 1]`: for each scored row of the student's sequence, the teacher row of the
    same response token in the teacher's sequence (`P_t + R - 1` rows), or `NO_ROW`."""
    if student_prompt_len < 1 or teacher_prompt_len < 1 or response_len < 1:
        raise ValueError(f"prompt and response lengths: expected >= 1, got student prompt "
                         f"{student_prompt_len}, teacher prompt {teacher_prompt_len}, "
                         f"response {response_len}")
    index = torch.full((student_prompt_len + response_len - 1,), NO_ROW, dtype=torch.int64)
    first = teacher_prompt_len - 1  # the teacher row that predicts response token 0
    index[student_prompt_len - 1:] = torch.arange(first, first + response_len)
    return index


def packed_response_index(student_prompt_lens: Sequence[int], teacher_prompt_lens: Sequence[int],
                          response_lens: Sequence[int]) -> torch.Tensor:
    """int64 `[T_s]` over a packed micro-batch (every position of every student sequence, the last
    one included): the row of the teacher's packing of the same sequences (in the same order) that
    pairs with each student row, or `NO_ROW`."""
    if not len(student_prompt_lens) == len(teacher_prompt_lens) == len(response_lens):
        raise ValueError(f"lengths: expected one per sequence, got {len(student_prompt_lens)} student "
                         f"prompts, {len(teacher_prompt_lens)} teacher prompts, "
                         f"{len(response_lens)} responses")
    parts, offset = [], 0
    for p_s, p_t, r in zip(student_prompt_lens, teacher_prompt_lens, response_lens):
        index = response_row_index(p_s, p_t, r)
        parts += [torch.where(index >= 0, index + offset, index), torch.tensor([NO_ROW])]
        offset += p_t + r
    return torch.cat(parts)


def _take(rows: torch.Tensor, index: torch.Tensor, fill: float) -> torch.Tensor:
    out = rows.index_select(0, index.clamp(min=0))
    return out.masked_fill_((index < 0).unsqueeze(1), fill)


def gather_rows(rows, index: torch.Tensor):
    """`rows` (a `DenseTeacher`, `TopKTeacher`, `HiddenTeacher` or a `[N, X]` tensor) re-ordered into
    the student's layout: row t is `rows[index[t]]`, a padding row where `index[t]` is `NO_ROW`."""
    index = index.to(_first(rows).device)
    if isinstance(rows, torch.Tensor):
        return _take(rows, index, 0.0)
    if isinstance(rows, DenseTeacher):
        return DenseTeacher(logits=_take(rows.logits, index, 0.0))
    if isinstance(rows, TopKTeacher):
        return TopKTeacher(ids=_take(rows.ids, index, PAD_ID),
                           logprobs=_take(rows.logprobs, index, -math.inf))
    if isinstance(rows, HiddenTeacher):
        return HiddenTeacher(hidden=_take(rows.hidden, index, 0.0), weight=rows.weight,
                             vocab_size=rows.vocab_size)
    raise TypeError(f"rows: expected teacher rows or a tensor, got {type(rows).__name__}")


def _first(rows) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows
    if isinstance(rows, DenseTeacher):
        return rows.logits
    return rows.hidden if isinstance(rows, HiddenTeacher) else getattr(rows, "ids", rows)


def pair_scored_rows(rows, student_prompt_len: int, teacher_prompt_len: int, response_len: int):
    """A scoring teacher's rows of `teacher prompt + response` (`P_t + R - 1` rows) in the layout of
    the student's sequence (`P_s + R - 1` rows); None stays None (scored inside the step)."""
    if rows is None:
        return None
    return gather_rows(rows, response_row_index(student_prompt_len, teacher_prompt_len, response_len))
