"""`logprobs_at`: the student's log-probabilities at a few global ids per row, over a vocabulary
sharded across a tensor-parallel group, differentiable, with no full-size temporaries.

    out[n, c] = z[n, ids[n, c]] / T - logsumexp_V(z[n] / T)        (ids -1: padding, value unused)

Forward: one pass over the logits for the row maxima and one for the sums of exponentials, row
chunk by row chunk (float32 or float64 only for one chunk), one MAX and two SUM all-reduces of
`[N]` / `[N, C]`. Backward (local, as Megatron's vocab-parallel cross entropy):

    d out[n, c] / d z[n, j] = ([j = ids[n, c]] - softmax(z[n] / T)_j) / T

written chunk by chunk into the one gradient buffer. Every rank of the group must receive the
same upstream gradient (the loss built on `out` is identical on every rank).

Shape legend: N rows, V_local vocabulary entries on this rank, C ids per row.
"""
from __future__ import annotations

import torch

from opkd_mcore.losses import vocab_parallel as vp

# bytes of one chunk's float32 logits: bounds the forward's and backward's temporaries
CHUNK_BYTES = 64 << 20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunks(z: torch.Tensor):
    rows = max(1, CHUNK_BYTES // max(1, z.shape[1] * 4))
    for start in range(0, z.shape[0], rows):
        yield slice(start, min(start + rows, z.shape[0]))


class LogProbsAt(torch.autograd.Function):
    """forward(z [N, V_local], ids [N, C] global, temperature, group) -> log q [N, C]."""

    @staticmethod
    def forward(ctx, z, ids, temperature, group):
        dtype = _compute_dtype(z.dtype)
        inv_t = 1.0 / temperature
        row_max = torch.empty(z.shape[0], dtype=dtype, device=z.device)
        for rows in _row_chunks(z):
            row_max[rows] = z[rows].to(dtype).amax(dim=1) * inv_t
        vp.all_reduce_max_(row_max, group)
        sumexp = torch.empty_like(row_max)
        for rows in _row_chunks(z):
            sumexp[rows] = torch.exp(z[rows].to(dtype) * inv_t - row_max[rows, None]).sum(dim=1)
        vp.all_reduce_sum_(sumexp, group)
        lse = row_max + torch.log(sumexp)
        index, on_shard = vp.local_index(ids, z.shape[1], vp.shard_offset(z.shape[1], group))
        picked = vp.gather_local(z, index, on_shard).to(dtype) * inv_t
        vp.all_reduce_sum_(picked, group)
        ctx.save_for_backward(z, index, on_shard, lse)
        ctx.inv_t = inv_t
        ctx.mark_non_differentiable(ids)
        return picked - lse[:, None]

    @staticmethod
    def backward(ctx, grad_NC):
        z, index, on_shard, lse = ctx.saved_tensors
        dtype, inv_t = lse.dtype, ctx.inv_t
        g = grad_NC.to(dtype) * inv_t
        g_sum = g.sum(dim=1)
        on_ids = torch.where(on_shard, g, torch.zeros_like(g))
        grad = torch.empty_like(z)
        for rows in _row_chunks(z):
            part = torch.exp(z[rows].to(dtype) * inv_t - lse[rows, None]) * -g_sum[rows, None]
            part.scatter_add_(1, index[rows], on_ids[rows])
            grad[rows] = part.to(z.dtype)
        return grad, None, None, None


def logprobs_at(student_logits_NV: torch.Tensor, ids_NC: torch.Tensor, *, temperature: float = 1.0,
                tp_group=None) -> torch.Tensor:
    """log softmax(z / T) at the global `ids` (`[N, C]` int64; -1 = padding, value meaningless),
    `[N, C]` float32 (float64 for float64 logits); differentiable w.r.t. the logits only."""
    if ids_NC.dim() != 2 or ids_NC.shape[0] != student_logits_NV.shape[0]:
        raise ValueError(f"ids: expected [N, C] with N = {student_logits_NV.shape[0]} rows, "
                         f"got {tuple(ids_NC.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    return LogProbsAt.apply(student_logits_NV, ids_NC.long(), float(temperature), tp_group)
