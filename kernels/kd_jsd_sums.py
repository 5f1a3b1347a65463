"""Triton kernel: the second pass JSD(beta) needs, once the global log-partitions are known.

With log q = s - lse_s, log p = u - lse_u and m = beta p + (1 - beta) q (0 < beta < 1: beta = 0 / 1
run as forward / reverse KL), per row over this shard:
    sums[:, 0] = sum beta p (log p - log m) + (1 - beta) q (log q - log m)   # the loss part
    sums[:, 1] = sum q (log q - log m)                                      # KL(q||m), for the gradient
Terms with p == 0 or q == 0 are 0 (x log x -> 0). The TP group SUM-reduces both columns.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._jit import lazy_jit
from ._log2 import LN2, LOG2E


def _kd_jsd_sums_kernel(z_ptr, t_ptr, lse_ptr, out_ptr, z_stride, t_stride, V, inv_T,
                        beta, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    # base-2 logs: each exp2 fed by one FMA, m formed in linear space and one log2 (3 transcendentals
    # per element, not logaddexp's 5: the pass is ALU-bound); scaled back to nats once per row
    c = inv_T * LOG2E
    lse_s2 = tl.load(lse_ptr + row * 2) * LOG2E
    lse_u2 = tl.load(lse_ptr + row * 2 + 1) * LOG2E
    acc_loss = tl.zeros([BLOCK_V], tl.float32)
    acc_kqm = tl.zeros([BLOCK_V], tl.float32)
    for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
        cols = start + offs
        mask = cols < V
        log2_q = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32) * c - lse_s2
        log2_p = tl.load(t_ptr + row * t_stride + cols, mask=mask, other=0.0).to(tl.float32) * c - lse_u2
        q = tl.exp2(log2_q)
        p = tl.exp2(log2_p)
        m = beta * p + (1.0 - beta) * q
        log2_m = tl.log2(m)
        # m >= (1 - beta) q and m >= beta p: a term with q > 0 (p > 0) is finite unless m underflows,
        # where the term is ~0
        q_term = tl.where(mask & (q > 0) & (m > 0), q * (log2_q - log2_m), 0.0)
        p_term = tl.where(mask & (p > 0) & (m > 0), p * (log2_p - log2_m), 0.0)
        acc_loss += beta * p_term + (1.0 - beta) * q_term
        acc_kqm += q_term
    tl.store(out_ptr + row * 2, tl.sum(acc_loss, 0) * LN2)
    tl.store(out_ptr + row * 2 + 1, tl.sum(acc_kqm, 0) * LN2)


_KERNEL = lazy_jit(_kd_jsd_sums_kernel)


def jsd_sums(student: torch.Tensor, teacher: torch.Tensor, lse: torch.Tensor, inv_temperature: float,
             beta: float, block_v: int, num_warps: int, num_stages: int = 1) -> torch.Tensor:
    """`[N, 2]` float32: this shard's (JSD loss part, KL(q||m) part); `lse [N, 2]` = (lse_s, lse_u)."""
    n_rows, vocab = student.shape
    out = torch.empty((n_rows, 2), dtype=torch.float32, device=student.device)
    if n_rows == 0:
        return out
    _KERNEL.get()[(n_rows,)](
        student, teacher, lse, out, student.stride(0), teacher.stride(0), vocab,
        float(inv_temperature), float(beta), BLOCK_V=block_v, NUM_STAGES=num_stages, num_warps=num_warps,
    )
    return out
