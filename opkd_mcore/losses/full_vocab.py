"""Exact divergence over the whole (sharded) vocabulary for a dense teacher: `support=None`.

Forward and reverse KL cost one MAX all-reduce of `[N, 2]` (student and teacher maxima) and one
SUM all-reduce of `[N, 3]` (sums of exponentials and the partial value). JSD needs one more SUM
of `[N, 2]` (value and the scalar of its gradient), since log m needs normalised p and q.
Backward is local to the shard: it recomputes the log-probabilities from the saved logits and
log-sum-exps. Work buffers are overwritten in place, so temporaries stay at a few `[N, V_local]`
(measured peak, forward + backward incl. the gradient: ~3.3x one buffer for KL, ~5.3x for JSD);
nothing of size V is ever gathered. `kd_loss(token_chunk=...)` bounds N.

Shape legend: N tokens, V_local vocab entries on this rank.
"""
from __future__ import annotations

import torch

from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.divergences import divergence_grad_, effective_divergence, jsd_row_sums_


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 in -> float64 math; every other float type (bf16, fp16, fp32) -> fp32 math."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def global_log_softmax_stats(xs_NV: list[torch.Tensor], excludes: list[torch.Tensor | None], group,
                             extra_sum_NX: torch.Tensor | None = None
                             ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Group-wide log-sum-exp of several `[N, V_local]` tensors with one MAX and one SUM all-reduce.

    `excludes[i]` (bool `[N, V_local]` or None) drops entries of `xs_NV[i]` from its sum;
    `extra_sum_NX` (partial sums of any width) rides along in the same SUM all-reduce and is
    returned reduced.
    """
    maxes = torch.stack([vp.local_max(x, ex) for x, ex in zip(xs_NV, excludes)], dim=1)
    vp.all_reduce_max_(maxes, group)
    sums = torch.stack([vp.local_sumexp(x, maxes[:, i], ex)
                        for i, (x, ex) in enumerate(zip(xs_NV, excludes))], dim=1)
    width = len(xs_NV)
    if extra_sum_NX is not None:
        sums = torch.cat([sums, extra_sum_NX.to(sums.dtype)], dim=1)
    vp.all_reduce_sum_(sums, group)
    lses = [vp.logsumexp_from(maxes[:, i], sums[:, i]) for i in range(width)]
    return lses, (sums[:, width:] if extra_sum_NX is not None else None)


def scaled_copy(x: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """A fresh buffer holding `x / T` in `dtype`, which the caller may overwrite in place."""
    out = x.to(dtype, copy=True)
    return out.div_(temperature) if temperature != 1.0 else out


def _kl_two_collectives(z, t, kind, group):
    """KL(p||q) or KL(q||p) with one MAX and one SUM all-reduce; overwrites `z` and `t`.

    KL(p||q) = sum_j p_j (t_j - z_j) - (lse_t - lse_z), and sum_j p_j (t_j - z_j) is a sum of
    per-shard partials exp(t_j - max_t) (t_j - z_j) / sumexp_t once the global max is known, so it
    rides in the same SUM all-reduce as the sums of exponentials. Reverse KL swaps the roles.
    """
    maxes = torch.stack([vp.local_max(z), vp.local_max(t)], dim=1)
    vp.all_reduce_max_(maxes, group)
    diff = t - z if kind == "forward_kl" else z - t
    exp_z = z.sub_(vp.finite_or_zero(maxes[:, 0])[:, None]).exp_()
    exp_t = t.sub_(vp.finite_or_zero(maxes[:, 1])[:, None]).exp_()
    weight = exp_t if kind == "forward_kl" else exp_z
    # entries masked to -inf in both (e.g. Megatron's vocab padding) have weight 0 and a NaN diff
    weighted = diff.mul_(weight).masked_fill_(weight == 0, 0.0)
    sums = torch.stack([exp_z.sum(dim=1), exp_t.sum(dim=1), weighted.sum(dim=1)], dim=1)
    vp.all_reduce_sum_(sums, group)
    lse_z = vp.logsumexp_from(maxes[:, 0], sums[:, 0])
    lse_t = vp.logsumexp_from(maxes[:, 1], sums[:, 1])
    if kind == "forward_kl":
        return sums[:, 2] / sums[:, 1] - (lse_t - lse_z), lse_z, lse_t
    return sums[:, 2] / sums[:, 0] - (lse_z - lse_t), lse_z, lse_t


def _jsd_three_collectives(z, t, beta, group):
    """JSD needs normalised p and q per entry (for log m), so its value takes a second SUM.
    Overwrites `z` and `t` with the log-probabilities."""
    (lse_z, lse_t), _ = global_log_softmax_stats([z, t], [None, None], group)
    value, kl_qm = jsd_row_sums_(t.sub_(lse_t[:, None]), z.sub_(lse_z[:, None]), beta)
    sums = torch.stack([value, kl_qm], dim=1)
    vp.all_reduce_sum_(sums, group)
    return sums[:, 0].clone(), sums[:, 1].clone(), lse_z, lse_t


class FullVocabKD(torch.autograd.Function):
    """forward(student_logits, teacher_logits, temperature, divergence, beta, group) -> loss [N].

    Differentiable w.r.t. `student_logits` only; the gradient w.r.t. the raw logits includes 1/T.
    """

    @staticmethod
    def forward(ctx, student_NV, teacher_NV, temperature, divergence, beta, group):
        dtype = compute_dtype(student_NV.dtype)
        z = scaled_copy(student_NV, dtype, temperature)
        t = scaled_copy(teacher_NV, dtype, temperature)
        if effective_divergence(divergence, beta) == "jsd":
            value, scalar, lse_z, lse_t = _jsd_three_collectives(z, t, beta, group)
        else:
            value, lse_z, lse_t = _kl_two_collectives(z, t, effective_divergence(divergence, beta), group)
            scalar = value
        ctx.save_for_backward(student_NV, teacher_NV, lse_z, lse_t, scalar)
        ctx.args = (temperature, divergence, beta)
        return value

    @staticmethod
    def backward(ctx, grad_N):
        student_NV, teacher_NV, lse_z, lse_t, scalar_N = ctx.saved_tensors
        temperature, divergence, beta = ctx.args
        dtype = lse_z.dtype
        log_q = scaled_copy(student_NV, dtype, temperature).sub_(lse_z[:, None])
        log_p = scaled_copy(teacher_NV, dtype, temperature).sub_(lse_t[:, None])
        grad = divergence_grad_(log_p, log_q, scalar_N, divergence, beta)
        grad.mul_((grad_N.to(dtype) / temperature)[:, None])
        return grad.to(student_NV.dtype), None, None, None, None, None


def full_vocab_kd(student_NV, teacher_NV, *, temperature, divergence, beta, group) -> torch.Tensor:
    """Exact D(p||q) over the full vocabulary; teacher logits are treated as constants."""
    return FullVocabKD.apply(student_NV, teacher_NV.detach(), float(temperature), divergence, float(beta),
                             group)
