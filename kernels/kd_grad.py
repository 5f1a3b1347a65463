"""Triton kernel: write d loss / d student_logits for one shard, optionally into the logits buffer.

Per element (s = z / T, log q = s - lse_s, log p = u - lse_u; c0, c1 per row, c0 already holds
grad_output / T and any divergence factor):
    DIVERGENCE 0 (sparse support; only the full-vocab log-partition term):  g = c0 q
    DIVERGENCE 1 (forward KL):  g = c0 (q - p)
    DIVERGENCE 2 (reverse KL):  g = c0 q (log q - log p - c1)          c1 = KL(q||p)
    DIVERGENCE 3 (JSD beta):    g = c0 q (log q - log m - c1)          c1 = KL(q||m), c0 has (1 - beta)
Each program reads a block of its row and then writes the same block, so `out` may be the
student buffer itself (in-place gradient, no [N, V] temporary), as Megatron's vocab-parallel
cross entropy does.
"""
from __future__ import annotations

import math

import torch
import triton.language as tl

from ._jit import lazy_jit

DIV_SPARSE_ONLY, DIV_FORWARD_KL, DIV_REVERSE_KL, DIV_JSD = 0, 1, 2, 3


def _kd_grad_kernel(z_ptr, t_ptr, g_ptr, lse_ptr, coef_ptr, z_stride, t_stride, g_stride, V,
                    inv_T, log_beta, log_1m_beta,
                    DIVERGENCE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    lse_s = tl.load(lse_ptr + row * 2)
    lse_u = tl.load(lse_ptr + row * 2 + 1)
    c0 = tl.load(coef_ptr + row * 2)
    c1 = tl.load(coef_ptr + row * 2 + 1)
    # q = exp2(z * inv_T * log2 e - lse_s * log2 e): one FMA feeds each exp2 (the pass is ALU-bound)
    c = inv_T * 1.4426950408889634
    lse_s2 = lse_s * 1.4426950408889634
    lse_u2 = lse_u * 1.4426950408889634
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.exp2(z * c - lse_s2)
        if DIVERGENCE == 0:
            g = c0 * q
        else:
            t = tl.load(t_ptr + row * t_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if DIVERGENCE == 1:
                g = c0 * (q - tl.exp2(t * c - lse_u2))
            else:
                log_q = z * inv_T - lse_s
                log_p = t * inv_T - lse_u
                if DIVERGENCE == 2:
                    g = tl.where(q > 0, c0 * q * (log_q - log_p - c1), 0.0)
                else:
                    la = log_p + log_beta
                    lb = log_q + log_1m_beta
                    mx = tl.maximum(la, lb)
                    log_m = mx + tl.log(tl.exp(la - mx) + tl.exp(lb - mx))
                    g = tl.where(q > 0, c0 * q * (log_q - log_m - c1), 0.0)
        tl.store(g_ptr + row * g_stride + cols, g.to(g_ptr.dtype.element_ty), mask=mask)


_KERNEL = lazy_jit(_kd_grad_kernel)


def write_grad(student: torch.Tensor, teacher: torch.Tensor | None, out: torch.Tensor,
               lse: torch.Tensor, coef: torch.Tensor, inv_temperature: float, beta: float,
               divergence_code: int, block_v: int, num_warps: int) -> torch.Tensor:
    """Fill `out [N, V_local]` (may be `student` itself) with the gradient; returns `out`."""
    n_rows, vocab = student.shape
    if n_rows == 0:
        return out
    t = student if teacher is None else teacher
    # log(beta) only matters for JSD, where 0 < beta < 1; keep the arguments finite otherwise.
    b = beta if 0.0 < beta < 1.0 else 0.5
    _KERNEL.get()[(n_rows,)](
        student, t, out, lse, coef, student.stride(0), t.stride(0), out.stride(0), vocab,
        float(inv_temperature), math.log(b), math.log1p(-b),
        DIVERGENCE=divergence_code, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out
