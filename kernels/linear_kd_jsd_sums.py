"""Triton kernel: the JSD(beta) sums of the fused LM-head loss, from recomputed logit tiles.

Once the global log-partitions are known (lse [N, 2] = (lse_s, lse_u)), each program recomputes
the tiles s = h W^T / T and u = h_t W_t^T / T of its rows and vocabulary split (as in
linear_kd_row_stats.py) and accumulates, with log q = s - lse_s, log p = u - lse_u and
log m = logaddexp(log beta + log p, log(1 - beta) + log q) (kd_jsd_sums.py forms m in linear space
with one log2 instead; these tiles still use logaddexp):
    sums[:, 0] = sum beta p (log p - log m) + (1 - beta) q (log q - log m)     # the loss part
    sums[:, 1] = sum q (log q - log m)                                        # KL(q||m), for the gradient
Terms with p == 0 or q == 0 are 0. Output `[N, S, 2]` float32; the splits and the TP group sum it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit
from ._logit_tile import dot_operands, logit_tile


def _linear_kd_jsd_sums_kernel(
        x_ptr, w_ptr, xt_ptr, wt_ptr, lse_ptr, out_ptr,
        N, V, H, HT, x_rs, w_rs, xt_rs, wt_rs, s_end, t_end, cols_per_split, inv_T,
        beta, log_beta, log_1m_beta,
        NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_n = pid // NUM_SPLITS
    pid_s = pid % NUM_SPLITS
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    lse_s = tl.load(lse_ptr + rows * 2, mask=row_ok, other=0.0)
    lse_u = tl.load(lse_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
    v_lo = pid_s * cols_per_split
    v_hi = tl.minimum(V, v_lo + cols_per_split)
    acc_loss = tl.zeros([BLOCK_N], tl.float32)
    acc_kqm = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        s = logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, x_rs, w_rs, s_end, inv_T,
                       DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
        u = logit_tile(xt_ptr, wt_ptr, rows, cols, row_ok, col_ok, HT, xt_rs, wt_rs, t_end, inv_T,
                       DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
        log_q = s - lse_s[:, None]
        log_p = u - lse_u[:, None]
        q = tl.exp(log_q)
        p = tl.exp(log_p)
        la = log_p + log_beta
        lb = log_q + log_1m_beta
        mx = tl.maximum(la, lb)
        log_m = mx + tl.log(tl.exp(la - mx) + tl.exp(lb - mx))
        live = row_ok[:, None] & col_ok[None, :]
        q_term = tl.where(live & (q > 0), q * (log_q - log_m), 0.0)
        p_term = tl.where(live & (p > 0), p * (log_p - log_m), 0.0)
        acc_loss += tl.sum(beta * p_term + (1.0 - beta) * q_term, 1)
        acc_kqm += tl.sum(q_term, 1)
    out = out_ptr + (rows * NUM_SPLITS + pid_s) * 2
    tl.store(out, acc_loss, mask=row_ok)
    tl.store(out + 1, acc_kqm, mask=row_ok)


_KERNEL = lazy_jit(_linear_kd_jsd_sums_kernel)


def linear_jsd_sums(x, w, xt, wt, lse, s_end: int, t_end: int, inv_temperature: float, beta: float,
                    num_splits: int, block_n: int, block_v: int, block_k: int, num_warps: int,
                    num_stages: int) -> torch.Tensor:
    """`[N, S, 2]` float32: this shard's (JSD loss part, KL(q||m) part) per vocabulary split."""
    n, h = x.shape
    v = w.shape[0]
    out = torch.empty((n, num_splits, 2), dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    cols_per_split = triton.cdiv(triton.cdiv(v, num_splits), block_v) * block_v
    grid = (triton.cdiv(n, block_n) * num_splits,)
    dot_dtype, precision = dot_operands(x)
    _KERNEL.get()[grid](
        x, w, xt, wt, lse, out, n, v, h, xt.shape[1], x.stride(0), w.stride(0), xt.stride(0), wt.stride(0),
        s_end, t_end, cols_per_split, float(inv_temperature), float(beta), math.log(beta), math.log1p(-beta),
        NUM_SPLITS=num_splits, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, BLOCK_N=block_n, BLOCK_V=block_v,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out
