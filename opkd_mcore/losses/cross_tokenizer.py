"""Distillation across tokenizers: the loss over aligned spans (`loss.cross_tokenizer`).

Input: the student's vocab-parallel logits `[N, V_local]`, a `CrossTokenizerTeacher` (the
teacher's rows on its own tokens and the `SpanIndex` pairing them with the student's rows,
`losses/span_teacher.py`), the student's next tokens and the teacher-to-student vocabulary map
(`data/token_alignment.py`). Three modes (docs/losses.md, "Across tokenizers"):

* `exact`: on each 1:1 span whose two tokens are the same string, `kd_loss` with the teacher's
  top-k ids mapped to student ids (ids the student's vocabulary lacks are dropped: with
  `mass: tail` their probability is the tail outcome, with `renorm` the rest is renormalised),
  through the fused sparse-support kernels. Other spans: no loss. With two identical tokenizers
  every span is 1:1 and mapped, and the loss is the same-tokenizer loss, bit for bit.
* `uld`: on every span, the universal logit distillation distance (Boizard et al., 2024): the L1
  distance between the two distributions' probabilities sorted in decreasing order. A span of
  several tokens uses the span's probability on both sides, as TRL's GOLD trainer merges tokens
  ("observed" strategy): the distribution at the span's first row times the probability of the
  span's later actual tokens, so the actual span gets its joint probability (the sum of its
  tokens' log-probabilities) and the other first tokens are scaled alike. With top-k rows the
  distance is taken on the K largest entries plus one tail entry holding the rest of each side's
  mass: `sum_{i<K} |a_(i) - b_(i)| + |A_rest - B_rest|`, a lower bound of the full distance
  (equal when K covers the vocabulary).
* `gold`: `exact` on the spans it covers and `uld` on the others, weighted by
  `loss.gold_exact_weight` and `loss.gold_uld_weight`.

The loss of a span sits on its first student row (later rows of the span carry 0), so a token-mean
aggregation divides by the student's response tokens as in the same-tokenizer loss. The forward
forms nothing of size `[N, V]` beyond what `kd_loss` forms: the student's top-K and its
log-probabilities at K+1 ids (`logprobs_at`, float32 one row chunk at a time), the teacher's top-K
rows. In backward the fused kernels write the exact term's gradient into the logits buffer as for
one tokenizer; the ULD term adds one gradient buffer of the logits' shape and dtype (its softmax
term reaches every column of its rows), filled chunk by chunk.

Shape legend: N student rows, M teacher rows, K top-k width, V_local this rank's vocabulary shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.kd_loss import kd_loss_with_stats
from opkd_mcore.losses.logprobs_at import logprobs_at
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher, teacher_topk
from opkd_mcore.losses.teacher_outputs import PAD_ID, TopKTeacher

CROSS_TOKENIZER_LOSSES = ("exact", "uld", "gold")


@dataclass(frozen=True)
class CrossTokenizerStats:
    """Per student row, for logging: which rows took which loss, the exact rows' teacher mass on
    the mapped ids, and the ULD distance (0 where none)."""

    exact_rows: torch.Tensor
    uld_rows: torch.Tensor
    teacher_mass: torch.Tensor
    uld: torch.Tensor


def cross_tokenizer_loss(student_logits: torch.Tensor, teacher: CrossTokenizerTeacher,
                         next_tokens: torch.Tensor, teacher_to_student: torch.Tensor, *, mode: str,
                         divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                         mass: str = "renorm", coverage_coef: float = 0.0, k: int | None = None,
                         exact_weight: float = 1.0, uld_weight: float = 1.0, tp_group=None,
                         impl: str = "auto") -> tuple[torch.Tensor, CrossTokenizerStats]:
    """Per-student-row loss `[N]` (float32; float64 for float64 logits) and its stats.

    `next_tokens [N]`: the student token each row scores; `teacher_to_student [V_teacher]`: student
    id of each teacher id (-1: none); `k`: the top-k width taken from dense teacher rows (top-k rows:
    the exact term keeps the k most probable mapped ids, as `kd_loss` truncates). The divergence
    keywords are `kd_loss`'s (support: the mapped teacher ids)."""
    if mode not in CROSS_TOKENIZER_LOSSES:
        raise ValueError(f"mode: expected one of {CROSS_TOKENIZER_LOSSES}, got {mode!r}")
    if teacher.rows is None:
        raise ValueError("teacher.rows: the teacher's rows are missing (an in-step teacher fills them "
                         "in the step)")
    idx = teacher.index
    if idx.num_student_rows != student_logits.shape[0]:
        raise ValueError(f"teacher: expected {student_logits.shape[0]} student rows, "
                         f"got {idx.num_student_rows}")
    t_ids, t_lp, t_next = teacher_topk(teacher.rows, idx.teacher_next, k=k, temperature=temperature,
                                       group=tp_group)
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    zeros = torch.zeros(student_logits.shape[0], dtype=dtype, device=student_logits.device)
    exact_rows = idx.exact_row >= 0 if mode != "uld" else torch.zeros_like(idx.exact_row, dtype=torch.bool)
    loss, teacher_mass, uld = zeros, zeros, zeros
    if mode != "uld":
        truncate = k if isinstance(teacher.rows, TopKTeacher) else None
        kd = dict(divergence=divergence, beta=beta, temperature=temperature, support="teacher", k=truncate,
                  mass=mass, coverage_coef=coverage_coef)
        mapped = mapped_topk(t_ids, t_lp, idx.exact_row, teacher_to_student)
        loss, teacher_mass = _exact_loss(student_logits, mapped, kd, tp_group, impl)
        if mode == "exact":
            return loss, CrossTokenizerStats(exact_rows, torch.zeros_like(exact_rows), teacher_mass, zeros)
        loss = exact_weight * loss
    # The ULD term is built after the exact one, so autograd runs its backward first (a later node,
    # a higher sequence number): it reads the logits before the fused kernels write their gradient
    # into the logits buffer, as they do for one tokenizer. Were the order reversed, autograd would
    # refuse the ULD backward (the kernels bump the buffer's version), never read a gradient.
    uld_rows = (idx.span_row >= 0) & ~exact_rows
    uld = uld_distance(student_logits, t_lp, t_next, teacher, next_tokens, uld_rows, temperature, tp_group)
    return loss + uld_weight * uld, CrossTokenizerStats(exact_rows, uld_rows, teacher_mass, uld.detach())


def mapped_topk(t_ids_MK: torch.Tensor, t_lp_MK: torch.Tensor, rows_N: torch.Tensor,
                teacher_to_student: torch.Tensor) -> TopKTeacher:
    """Teacher row `rows_N[n]` (-1: none) with its ids mapped to student ids; unmapped entries and
    rows without a teacher row become padding (id -1, logprob -inf)."""
    src = rows_N.clamp(min=0)
    ids, lp = t_ids_MK[src], t_lp_MK[src]
    size = teacher_to_student.numel()
    table = teacher_to_student.to(ids.device)
    inside = (ids >= 0) & (ids < size)
    s_ids = torch.where(inside, table[ids.clamp(0, size - 1)], torch.full_like(ids, PAD_ID))
    keep = (rows_N >= 0)[:, None] & (s_ids >= 0)
    return TopKTeacher(torch.where(keep, s_ids, torch.full_like(s_ids, PAD_ID)),
                       torch.where(keep, lp, torch.full_like(lp, -math.inf)))


def _exact_loss(logits, topk: TopKTeacher, kd: dict, tp_group, impl: str):
    """`kd_loss` on the mapped rows: `(loss [N], teacher mass [N])`."""
    loss, stats = kd_loss_with_stats(logits, topk, **kd, tp_group=tp_group, impl=impl, validate=False)
    return loss, stats.teacher_mass


def uld_distance(student_logits: torch.Tensor, t_lp_MK: torch.Tensor, t_next_M: torch.Tensor,
                 teacher: CrossTokenizerTeacher, next_tokens: torch.Tensor, rows_N: torch.Tensor,
                 temperature: float, tp_group) -> torch.Tensor:
    """The ULD distance of every span whose first student row is set in `rows_N` (module
    docstring), on that row; 0 elsewhere. Differentiable w.r.t. the student's logits."""
    idx = teacher.index
    n = student_logits.shape[0]
    width = min(t_lp_MK.shape[1], student_logits.shape[1] * vp.group_size(tp_group))
    top = vp.sharded_topk(student_logits.detach(), width, tp_group)
    lq = logprobs_at(student_logits, torch.cat([top, next_tokens[:, None].clamp(min=0)], dim=1),
                     temperature=temperature, tp_group=tp_group)
    lq_top, lq_next = lq[:, :width], lq[:, width]
    cont_s = _span_sums(idx.student_cont, lq_next, n)
    cont_t = _span_sums(idx.teacher_cont, t_next_M.to(lq.dtype), n)
    base_t = t_lp_MK[idx.span_row.clamp(min=0)].to(lq.dtype).sort(dim=1, descending=True).values
    a, b = torch.exp(lq_top + cont_s[:, None]), torch.exp(base_t + cont_t[:, None])
    tail_a = torch.exp(cont_s) * (1.0 - torch.exp(lq_top).sum(dim=1)).clamp(min=0.0)
    tail_b = torch.exp(cont_t) * (1.0 - torch.exp(base_t).sum(dim=1)).clamp(min=0.0)
    if b.shape[1] > width:   # more teacher entries than student ids: the extra ones face zeros
        a = torch.nn.functional.pad(a, (0, b.shape[1] - width))
    distance = (a - b).abs().sum(dim=1) + (tail_a - tail_b).abs()
    return torch.where(rows_N, distance, torch.zeros_like(distance))


def _span_sums(target_R: torch.Tensor, values_R: torch.Tensor, n: int) -> torch.Tensor:
    """`out[i] = sum of values[r] over rows r with target[r] = i` (target -1: not added); no host sync."""
    valid = target_R >= 0
    slot = torch.where(valid, target_R, torch.full_like(target_R, n))
    out = values_R.new_zeros(n + 1)
    return out.index_add(0, slot, torch.where(valid, values_R, torch.zeros_like(values_R)))[:n]
