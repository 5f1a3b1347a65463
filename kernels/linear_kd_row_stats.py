"""Triton kernel: pass 1 of the fused LM-head loss, row statistics from logit tiles on chip.

A program owns BLOCK_N rows and one split of this shard's vocabulary; for each BLOCK_V columns it
forms the logit tiles (`_logit_tile.py`: tl.dot, operands in their dtype, float32 accumulation)
    s = h[rows] @ W[cols]^T / T            u = h_t[rows] @ W_t[cols]^T / T   (dense teacher)
(float32 operands: exact IEEE products, not TF32; padding columns, at or past `s_end` / `t_end`,
get PAD_LOGIT / T) and folds them into running per-row statistics, the 2-D version of
kd_row_stats.py (online softmax, one max per row and tile):
    m' = max(m, max_j s_j)     l = l e^(m - m') + sum_j e^(s_j - m')
    a  = a e^(m_u - m_u') + sum_j e^(u_j - m_u') (u_j - s_j)          # -> sum p (u - s) = a / l_u
    b  = b e^(m_s - m_s') + sum_j e^(s_j - m_s') (s_j - u_j)          # -> sum q (s - u) = b / l_s
plus the column of the teacher's maximum (the first column wins a tie). Output per (row, split):
    stats [N, S, 6] float32 (m_s, l_s, m_u, l_u, a, b)     argmax [N, S] int32 (shard-local column)
`fused_kd.merge_stats` merges the splits; the TP reduce follows as for logits.
Splits are the fastest-varying program id, so programs running together share the h rows (L2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit
from ._logit_tile import dot_operands, logit_tile

_NEG = tl.constexpr(-1e30)   # not -inf: e^(m - m') stays finite while a row has seen nothing


def _linear_kd_row_stats_kernel(
        x_ptr, w_ptr, xt_ptr, wt_ptr, out_ptr, arg_ptr,
        N, V, H, HT, x_rs, w_rs, xt_rs, wt_rs, s_end, t_end, cols_per_split, inv_T,
        NUM_SPLITS: tl.constexpr, HAS_TEACHER: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_n = pid // NUM_SPLITS
    pid_s = pid % NUM_SPLITS
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    v_lo = pid_s * cols_per_split
    v_hi = tl.minimum(V, v_lo + cols_per_split)
    m_s = tl.full([BLOCK_N], _NEG, tl.float32)
    l_s = tl.zeros([BLOCK_N], tl.float32)
    m_u = tl.full([BLOCK_N], _NEG, tl.float32)
    l_u = tl.zeros([BLOCK_N], tl.float32)
    acc_a = tl.zeros([BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_N], tl.float32)
    best = tl.zeros([BLOCK_N], tl.int32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        s = logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, x_rs, w_rs, s_end, inv_T,
                       DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
        s = tl.where(col_ok[None, :], s, _NEG)
        m_s_new = tl.maximum(m_s, tl.max(s, 1))
        alpha_s = tl.exp(m_s - m_s_new)
        e_s = tl.where(col_ok[None, :], tl.exp(s - m_s_new[:, None]), 0.0)
        l_s = l_s * alpha_s + tl.sum(e_s, 1)
        if HAS_TEACHER:
            u = logit_tile(xt_ptr, wt_ptr, rows, cols, row_ok, col_ok, HT, xt_rs, wt_rs, t_end, inv_T,
                           DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
            u = tl.where(col_ok[None, :], u, _NEG)
            tile_max_u = tl.max(u, 1)
            tile_arg = tl.argmax(u, 1).to(tl.int32) + v0
            best = tl.where(tile_max_u > m_u, tile_arg, best)
            m_u_new = tl.maximum(m_u, tile_max_u)
            alpha_u = tl.exp(m_u - m_u_new)
            e_u = tl.where(col_ok[None, :], tl.exp(u - m_u_new[:, None]), 0.0)
            l_u = l_u * alpha_u + tl.sum(e_u, 1)
            diff = u - s
            acc_a = acc_a * alpha_u + tl.sum(tl.where(e_u > 0, e_u * diff, 0.0), 1)
            acc_b = acc_b * alpha_s + tl.sum(tl.where(e_s > 0, -e_s * diff, 0.0), 1)
            m_u = m_u_new
        m_s = m_s_new
    out = out_ptr + (rows * NUM_SPLITS + pid_s) * 6
    tl.store(out + 0, m_s, mask=row_ok)
    tl.store(out + 1, l_s, mask=row_ok)
    tl.store(out + 2, m_u, mask=row_ok)
    tl.store(out + 3, l_u, mask=row_ok)
    tl.store(out + 4, acc_a, mask=row_ok)
    tl.store(out + 5, acc_b, mask=row_ok)
    tl.store(arg_ptr + rows * NUM_SPLITS + pid_s, best, mask=row_ok)


_KERNEL = lazy_jit(_linear_kd_row_stats_kernel)


def linear_row_stats(x, w, xt, wt, s_end: int, t_end: int, inv_temperature: float, num_splits: int,
                     block_n: int, block_v: int, block_k: int, num_warps: int, num_stages: int):
    """Per-split stats `[N, S, 6]` float32 and teacher argmax `[N, S]` int32 (see the docstring)."""
    n, h = x.shape
    v = w.shape[0]
    out = torch.empty((n, num_splits, 6), dtype=torch.float32, device=x.device)
    arg = torch.zeros((n, num_splits), dtype=torch.int32, device=x.device)
    if n == 0:
        return out, arg
    cols_per_split = triton.cdiv(triton.cdiv(v, num_splits), block_v) * block_v
    has_teacher = xt is not None
    xt_, wt_ = (xt, wt) if has_teacher else (x, w)
    grid = (triton.cdiv(n, block_n) * num_splits,)
    dot_dtype, precision = dot_operands(x)
    _KERNEL.get()[grid](
        x, w, xt_, wt_, out, arg, n, v, h, xt_.shape[1], x.stride(0), w.stride(0), xt_.stride(0),
        wt_.stride(0), s_end, t_end, cols_per_split, float(inv_temperature),
        NUM_SPLITS=num_splits, HAS_TEACHER=has_teacher, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        BLOCK_N=block_n, BLOCK_V=block_v,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out, arg
