"""Triton kernel: one block of d loss / d logits for the fused LM-head backward, from recomputed tiles.

For a block of R rows x C vocabulary columns, each program recomputes its logit tiles
s = h W^T / T (and u = h_t W_t^T / T when the divergence needs the teacher) with tl.dot and writes
(the formulas of kd_grad.py; log q = s - lse_s, log p = u - lse_u; c0, c1 per row, c0 already
holding grad_output / T and the divergence factor):
    DIVERGENCE 0 (sparse support, the full-vocabulary log-partition term):  g = c0 q
    DIVERGENCE 1 (forward KL):  g = c0 (q - p)
    DIVERGENCE 2 (reverse KL):  g = c0 q (log q - log p - c1)          c1 = KL(q||p)
    DIVERGENCE 3 (JSD beta):    g = c0 q (log q - log m - c1)          c1 = KL(q||m)
into `dz [R, C]` in the dtype of the operands (bf16 on GPU: the dtype the two gradient GEMMs that
follow, dh += dz W and dW = dz^T h, read at tensor-core speed). Only this block of dz ever exists.
Programs are ordered in groups of GROUP_M row tiles so that tiles running together share W (L2).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit
from ._logit_tile import dot_operands, logit_tile


def _linear_kd_grad_kernel(
        x_ptr, w_ptr, xt_ptr, wt_ptr, lse_ptr, coef_ptr, dz_ptr,
        R, C, H, HT, x_rs, w_rs, xt_rs, wt_rs, dz_rs, s_end, t_end, inv_T, log_beta, log_1m_beta,
        DIVERGENCE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(R, BLOCK_N)
    num_v = tl.cdiv(C, BLOCK_V)
    per_group = GROUP_M * num_v
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    rows = (pid_m * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < R
    col_ok = cols < C
    s = logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, x_rs, w_rs, s_end, inv_T,
                   DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
    lse_s = tl.load(lse_ptr + rows * 2, mask=row_ok, other=0.0)
    c0 = tl.load(coef_ptr + rows * 2, mask=row_ok, other=0.0)
    c1 = tl.load(coef_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
    log_q = s - lse_s[:, None]
    q = tl.exp(log_q)
    if DIVERGENCE == 0:
        g = c0[:, None] * q
    else:
        u = logit_tile(xt_ptr, wt_ptr, rows, cols, row_ok, col_ok, HT, xt_rs, wt_rs, t_end, inv_T,
                       DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
        lse_u = tl.load(lse_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
        log_p = u - lse_u[:, None]
        if DIVERGENCE == 1:
            g = c0[:, None] * (q - tl.exp(log_p))
        elif DIVERGENCE == 2:
            g = tl.where(q > 0, c0[:, None] * q * (log_q - log_p - c1[:, None]), 0.0)
        else:
            la = log_p + log_beta
            lb = log_q + log_1m_beta
            mx = tl.maximum(la, lb)
            log_m = mx + tl.log(tl.exp(la - mx) + tl.exp(lb - mx))
            g = tl.where(q > 0, c0[:, None] * q * (log_q - log_m - c1[:, None]), 0.0)
    tl.store(dz_ptr + rows[:, None] * dz_rs + cols.to(tl.int64)[None, :], g.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


_KERNEL = lazy_jit(_linear_kd_grad_kernel)


def linear_grad_block(x, w, xt, wt, lse, coef, s_end: int, t_end: int, inv_temperature: float, beta: float,
                      code: int, block_n: int, block_v: int, block_k: int, group_m: int, num_warps: int,
                      num_stages: int) -> torch.Tensor:
    """`dz [R, C]` (dtype of `x`) for rows `x [R, H]` and columns `w [C, H]`; `lse`, `coef`: `[R, 2]`
    float32; `s_end` / `t_end`: block-local first padding column. `xt`, `wt` may be None for code 0."""
    r, h = x.shape
    c = w.shape[0]
    dz = torch.empty((r, c), dtype=x.dtype, device=x.device)
    if r == 0 or c == 0:
        return dz
    xt_, wt_ = (xt, wt) if xt is not None else (x, w)
    # log(beta) only matters for JSD, where 0 < beta < 1; keep the arguments finite otherwise.
    b = beta if 0.0 < beta < 1.0 else 0.5
    grid = (triton.cdiv(r, block_n) * triton.cdiv(c, block_v),)
    dot_dtype, precision = dot_operands(x)
    _KERNEL.get()[grid](
        x, w, xt_, wt_, lse, coef, dz, r, c, h, xt_.shape[1], x.stride(0), w.stride(0), xt_.stride(0),
        wt_.stride(0), dz.stride(0), s_end, t_end, float(inv_temperature), math.log(b), math.log1p(-b),
        DIVERGENCE=code, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, GROUP_M=group_m, BLOCK_N=block_n,
        BLOCK_V=block_v, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return dz
