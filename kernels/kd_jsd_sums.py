"""Triton kernel: the second pass JSD(beta) needs, once the global log-partitions are known.

With log q = s - lse_s, log p = u - lse_u and m = beta p + (1 - beta) q (computed in log space,
log m = logaddexp(log beta + log p, log(1 - beta) + log q)), per row over this shard:
    sums[:, 0] = sum beta p (log p - log m) + (1 - beta) q (log q - log m)   # the loss part
    sums[:, 1] = sum q (log q - log m)                                      # KL(q||m), for the gradient
Terms with p == 0 or q == 0 are 0 (x log x -> 0). The TP group SUM-reduces both columns.
"""
from __future__ import annotations

import math

import torch
import triton.language as tl

from ._jit import lazy_jit


def _kd_jsd_sums_kernel(z_ptr, t_ptr, lse_ptr, out_ptr, z_stride, t_stride, V, inv_T,
                        beta, log_beta, log_1m_beta, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    lse_s = tl.load(lse_ptr + row * 2)
    lse_u = tl.load(lse_ptr + row * 2 + 1)
    acc_loss = tl.zeros([BLOCK_V], tl.float32)
    acc_kqm = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        s = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32) * inv_T
        u = tl.load(t_ptr + row * t_stride + cols, mask=mask, other=0.0).to(tl.float32) * inv_T
        log_q = s - lse_s
        log_p = u - lse_u
        q = tl.exp(log_q)
        p = tl.exp(log_p)
        la = log_p + log_beta
        lb = log_q + log_1m_beta
        mx = tl.maximum(la, lb)
        log_m = mx + tl.log(tl.exp(la - mx) + tl.exp(lb - mx))
        q_term = tl.where(mask & (q > 0), q * (log_q - log_m), 0.0)
        p_term = tl.where(mask & (p > 0), p * (log_p - log_m), 0.0)
        acc_loss += beta * p_term + (1.0 - beta) * q_term
        acc_kqm += q_term
    tl.store(out_ptr + row * 2, tl.sum(acc_loss, 0))
    tl.store(out_ptr + row * 2 + 1, tl.sum(acc_kqm, 0))


_KERNEL = lazy_jit(_kd_jsd_sums_kernel)


def jsd_sums(student: torch.Tensor, teacher: torch.Tensor, lse: torch.Tensor, inv_temperature: float,
             beta: float, block_v: int, num_warps: int) -> torch.Tensor:
    """`[N, 2]` float32: this shard's (JSD loss part, KL(q||m) part); `lse [N, 2]` = (lse_s, lse_u)."""
    n_rows, vocab = student.shape
    out = torch.empty((n_rows, 2), dtype=torch.float32, device=student.device)
    if n_rows == 0:
        return out
    _KERNEL.get()[(n_rows,)](
        student, teacher, lse, out, student.stride(0), teacher.stride(0), vocab,
        float(inv_temperature), float(beta), math.log(beta), math.log1p(-beta),
        BLOCK_V=block_v, num_warps=num_warps,
    )
    return out
