"""Divergence on a sparse support S of token ids over a sharded vocabulary.

S holds at most C global ids per token (teacher top-k, or TCAD's union with the student's top-k),
padding is -1. The forward pass gathers the student (and dense-teacher) logits at S with one SUM
all-reduce that also carries the sums of exponentials, after one MAX all-reduce of the maxima.
Everything after that is computed on replicated `[N, C]` tensors, identically on every rank.

Every supported objective has a gradient w.r.t. z = logits / T of the form

    dL/dz_j = coef_j * [j in S]  +  a_full * q_j  +  a_tail * q_j / (1 - m_q) * [j not in S]

(q = softmax(z) over the full vocabulary, m_q = sum_S q), so backward keeps `coef [N, C]`,
`a_full [N]`, `a_tail [N]` and two log-sum-exps and writes the local shard's gradient with one
`scatter_add_` (safe for off-shard ids, which add 0 at index 0):

- renorm: coef = dD/du over S (Q = softmax of z restricted to S).
- tail: outcomes S + one tail outcome whose logit is logsumexp of z off S; coef = dD/du on S,
  a_tail = dD/du_tail.
- raw (forward KL only): L = sum_S p (log p - log q); coef = -p, a_full = m_p.
- coverage: c * (-log m_q); coef -= c * Q, a_full += c.

Why a second implementation of the sparse objective exists (`opkd_kernels.sparse_objective`, the
fused path's): this reference path holds the shard's logits, so it takes the log-partition off S
exactly (one masked logsumexp: the tail masses 1 - m_q and, for a dense teacher, 1 - m_p without
cancellation) and writes the analytic coefficients above in the logits' compute dtype (float64 for
float64 logits). The fused kernels never hold the logits, only the student's values at S and its
full log-partition, so they form the tail as 1 - exp(lse_S - lse) in float64 and take the gradient
w.r.t. those K + 1 values by float64 autograd. The same objective with the same teacher tail floor
(that module's); both are tested against `tests/losses_reference.py`.

Shape legend: N tokens, V_local vocab entries on this rank, C support ids per token.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from opkd_kernels.sparse_objective import TEACHER_TAIL_FLOOR
from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.divergences import divergence_grad, divergence_terms, weighted_log_ratio
from opkd_mcore.losses.full_vocab import compute_dtype, global_log_softmax_stats
from opkd_mcore.losses.teacher_outputs import PAD_ID, TopKTeacher

MASSES = ("renorm", "tail", "raw")
NEG_INF = float("-inf")


def _normalise(log_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities renormalised over the row, and the row's log-mass (-inf for empty rows)."""
    log_mass = torch.logsumexp(log_x, dim=1)
    return log_x - vp.finite_or_zero(log_mass)[:, None], log_mass


def _teacher_tail(log_mp: torch.Tensor, lse_t_notS: torch.Tensor | None, lse_t: torch.Tensor | None):
    """log(1 - m_p): exact from the dense teacher's logits, else from the top-k mass; floored."""
    if lse_t_notS is not None:
        log_tail = lse_t_notS - lse_t
    else:
        log_tail = torch.log(torch.clamp(-torch.expm1(log_mp), min=0.0))
    return torch.clamp(log_tail, min=math.log(TEACHER_TAIL_FLOOR))


def _objective(log_p_S, log_q_S, log_p_tail, log_q_tail, mass, divergence, beta, coverage_coef):
    """Value [N] and gradient coefficients (coef [N, C], a_full [N], a_tail [N]) on replicated data."""
    num_ids = log_q_S.shape[1]
    a_full = torch.zeros_like(log_q_S[:, 0])
    a_tail = torch.zeros_like(a_full)
    log_Q_S, log_mq = _normalise(log_q_S)
    if mass == "raw":
        value = weighted_log_ratio(log_p_S, log_q_S).sum(dim=1)
        coef = -torch.exp(log_p_S)
        a_full = torch.exp(torch.logsumexp(log_p_S, dim=1))
    else:
        if mass == "tail":
            log_P = torch.cat([log_p_S, log_p_tail[:, None]], dim=1)
            log_Q = torch.cat([log_q_S, log_q_tail[:, None]], dim=1)
        else:
            log_P, log_Q = _normalise(log_p_S)[0], log_Q_S
        value_terms, scalar_terms = divergence_terms(log_P, log_Q, divergence, beta)
        scalar = None if scalar_terms is None else scalar_terms.sum(dim=1)
        grad_u = divergence_grad(log_P, log_Q, scalar, divergence, beta)
        value = value_terms.sum(dim=1)
        coef = grad_u[:, :num_ids]
        if mass == "tail":
            a_tail = grad_u[:, num_ids]
    if coverage_coef:
        value = value - coverage_coef * log_mq
        coef = coef - coverage_coef * torch.exp(log_Q_S)
        a_full = a_full + coverage_coef
    return value, coef, a_full, a_tail


class SupportStatistics(NamedTuple):
    """Group-wide statistics of one call; `*_notS` only for the tail mass, `t*` only for a dense teacher."""

    lse_z: torch.Tensor
    lse_t: torch.Tensor | None
    lse_z_notS: torch.Tensor | None
    lse_t_notS: torch.Tensor | None
    z_S: torch.Tensor
    t_S: torch.Tensor | None


def _support_statistics(z, t, ids_NC, *, with_tail: bool, group) -> SupportStatistics:
    """Log-sum-exps (full and off S) and the logits at S, with one MAX and one SUM all-reduce."""
    v_local = z.shape[1]
    index, on_shard = vp.local_index(ids_NC, v_local, vp.shard_offset(v_local, group))
    in_S = vp.support_mask_local(index, on_shard, v_local) if with_tail else None
    xs = [z] if t is None else [z, t]
    excludes = [None] * len(xs)
    if with_tail:
        xs, excludes = xs + xs, excludes + [in_S] * len(xs)
    gathered = torch.cat([vp.gather_local(x, index, on_shard) for x in xs[: 1 if t is None else 2]], dim=1)
    lses, gathered = global_log_softmax_stats(xs, excludes, group, gathered)
    num_ids = ids_NC.shape[1]
    dense = t is not None
    return SupportStatistics(
        lse_z=lses[0],
        lse_t=lses[1] if dense else None,
        lse_z_notS=lses[2 if dense else 1] if with_tail else None,
        lse_t_notS=lses[3] if with_tail and dense else None,
        z_S=gathered[:, :num_ids],
        t_S=gathered[:, num_ids:] if dense else None,
    )


class SupportKD(torch.autograd.Function):
    """forward(student_logits, teacher_logits | None, ids, teacher_logprobs | None, temperature,
    divergence, beta, mass, coverage_coef, group) -> (loss [N], teacher_mass [N], student_mass [N]).

    Differentiable w.r.t. `student_logits` only (the masses are non-differentiable by-products).
    """

    @staticmethod
    def forward(ctx, student_NV, teacher_NV, ids_NC, teacher_logprobs_NC, temperature, divergence, beta,
                mass, coverage_coef, group):
        dtype = compute_dtype(student_NV.dtype)
        valid = ids_NC >= 0
        z = student_NV.to(dtype) / temperature
        t = teacher_NV.to(dtype) / temperature if teacher_NV is not None else None
        stats = _support_statistics(z, t, ids_NC, with_tail=mass == "tail", group=group)

        log_q_S = torch.where(valid, stats.z_S - stats.lse_z[:, None], NEG_INF)
        if t is not None:
            log_p_S = torch.where(valid, stats.t_S - stats.lse_t[:, None], NEG_INF)
        else:
            log_p_S = torch.where(valid, teacher_logprobs_NC.to(dtype), NEG_INF)
        log_mp = torch.logsumexp(log_p_S, dim=1)
        log_p_tail = log_q_tail = None
        if mass == "tail":
            log_p_tail = _teacher_tail(log_mp, stats.lse_t_notS, stats.lse_t)
            log_q_tail = stats.lse_z_notS - stats.lse_z
        value, coef, a_full, a_tail = _objective(log_p_S, log_q_S, log_p_tail, log_q_tail, mass, divergence,
                                                 beta, coverage_coef)

        # rows whose ids are all padding: loss 0, gradient 0 (their intermediates are -inf / NaN)
        row_ok = valid.any(dim=1)
        value, a_full, a_tail = (torch.where(row_ok, x, 0.0) for x in (value, a_full, a_tail))
        coef = torch.where(valid & row_ok[:, None], coef, 0.0)
        teacher_mass = torch.where(row_ok, torch.exp(log_mp), 0.0)
        student_mass = torch.where(row_ok, torch.exp(torch.logsumexp(log_q_S, dim=1)), 0.0)

        lse_notS = stats.lse_z_notS if stats.lse_z_notS is not None else torch.zeros_like(stats.lse_z)
        ctx.save_for_backward(student_NV, ids_NC, coef, a_full, a_tail, stats.lse_z, lse_notS)
        ctx.args = (temperature, mass, group, mass == "raw" or coverage_coef != 0.0)
        ctx.mark_non_differentiable(teacher_mass, student_mass)
        return value, teacher_mass, student_mass

    @staticmethod
    def backward(ctx, grad_N, _grad_teacher_mass, _grad_student_mass):
        student_NV, ids_NC, coef, a_full, a_tail, lse_z, lse_notS = ctx.saved_tensors
        temperature, mass, group, uses_full_softmax = ctx.args
        v_local = student_NV.shape[1]
        index, on_shard = vp.local_index(ids_NC, v_local, vp.shard_offset(v_local, group))
        z = student_NV.to(lse_z.dtype) / temperature  # a fresh buffer: the in-place ops below reuse it
        tail_share = None
        if mass == "tail":
            in_S = vp.support_mask_local(index, on_shard, v_local)
            tail_share = torch.exp(z - vp.finite_or_zero(lse_notS)[:, None]).masked_fill_(in_S, 0.0)
        if uses_full_softmax:  # raw mass or coverage: a_full * q over the whole shard
            grad = z.sub_(lse_z[:, None]).exp_().mul_(a_full[:, None])
        else:  # renorm / tail without coverage: a_full is 0, skip a pass of exp over the shard
            grad = z.zero_()
        if tail_share is not None:
            grad.add_(tail_share.mul_(a_tail[:, None]))
        grad.scatter_add_(1, index, torch.where(on_shard, coef, 0.0))
        grad.mul_((grad_N.to(grad.dtype) / temperature)[:, None])
        return grad.to(student_NV.dtype), None, None, None, None, None, None, None, None, None


@torch.no_grad()
def select_support(student_logits, teacher, *, support, k, group):
    """Support ids `[N, C]` (global, -1 = padding), top-k teacher logprobs `[N, C]` or None, and the
    student's top-k ids when they were computed (union), else None."""
    if isinstance(teacher, TopKTeacher):
        ids, logprobs = teacher.ids.long(), teacher.logprobs.detach()
        if k is not None and k < ids.shape[1]:
            keep = torch.where(ids != PAD_ID, logprobs, float("-inf")).topk(k, dim=1).indices
            ids, logprobs = ids.gather(1, keep), logprobs.gather(1, keep)
        return ids, logprobs, None
    teacher_ids = vp.sharded_topk(teacher.logits.detach(), k, group)
    if support == "teacher":
        return teacher_ids, None, None
    student_ids = vp.sharded_topk(student_logits.detach(), k, group)
    in_teacher = (student_ids[:, :, None] == teacher_ids[:, None, :]).any(dim=2)
    return torch.cat([teacher_ids, torch.where(in_teacher, PAD_ID, student_ids)], dim=1), None, student_ids
