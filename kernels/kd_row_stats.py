"""Triton kernel: one pass over a row of the local vocab shard -> the row's softmax statistics.

Per row n (s = student logits / T, u = teacher logits / T, sums over this shard only):
    m_s = max s            l_s = sum exp(s - m_s)
    m_u = max u            l_u = sum exp(u - m_u)
    a   = sum exp(u - m_u) * (u - s)      # -> sum p (u - s) = a / l_u   (forward KL)
    b   = sum exp(s - m_s) * (s - u)      # -> sum q (s - u) = b / l_s   (reverse KL)
One running max per row (a block reduction per step, one scalar rescale per block): 2 exps per
element with a teacher. Per-lane running maxima (no reduction in the loop, but a rescale exp per
element: 4 exps) measured 1.35x slower on an H200 at 16384 x 151936 (docs/benchmarks.md): the pass
is bound by exp throughput, not by the block reductions. The TP all-reduce (MAX of m, then SUM of
the rescaled l, a, b) happens outside, in `opkd_kernels.fused_kd`.
Output `stats [N, 6]` float32: (m_s, l_s, m_u, l_u, a, b); the teacher columns are 0 without one.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._jit import lazy_jit
from ._log2 import LOG2E

NUM_STATS = 6


def _kd_row_stats_kernel(z_ptr, t_ptr, out_ptr, z_stride, t_stride, V, inv_T, exp2_scale,
                         HAS_TEACHER: tl.constexpr, WANT_A: tl.constexpr, WANT_B: tl.constexpr,
                         BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    # Maxima and differences stay in raw logit units; 1/T and log2(e) enter once, as exp2_scale, in
    # the FMA that feeds each exp2 (the pass is ALU-bound: a separate scale and mask select per
    # element cost 20%). -1e30 rather than -inf: exp2 of (m_old - m_new) stays finite while a row
    # has seen only -inf; masked lanes load -inf, whose exp2 is 0.
    m_s = tl.max(tl.full([BLOCK_V], -1e30, tl.float32), 0)
    m_u = m_s
    l_s = tl.zeros([BLOCK_V], tl.float32)
    l_u = tl.zeros([BLOCK_V], tl.float32)
    acc_a = tl.zeros([BLOCK_V], tl.float32)
    acc_b = tl.zeros([BLOCK_V], tl.float32)
    for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
        cols = start + offs
        mask = cols < V
        s = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_s_new = tl.maximum(m_s, tl.max(s, 0))
        alpha_s = tl.exp2((m_s - m_s_new) * exp2_scale)
        e_s = tl.exp2(s * exp2_scale - m_s_new * exp2_scale)
        l_s = l_s * alpha_s + e_s
        if HAS_TEACHER:
            u = tl.load(t_ptr + row * t_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_u_new = tl.maximum(m_u, tl.max(u, 0))
            alpha_u = tl.exp2((m_u - m_u_new) * exp2_scale)
            e_u = tl.exp2(u * exp2_scale - m_u_new * exp2_scale)
            l_u = l_u * alpha_u + e_u
            # e == 0 guards 0 * inf (a -inf logit, or a masked lane's -inf - -inf)
            if WANT_A:
                acc_a = acc_a * alpha_u + tl.where(e_u > 0, e_u * (u - s), 0.0)
            if WANT_B:
                acc_b = acc_b * alpha_s + tl.where(e_s > 0, e_s * (s - u), 0.0)
            m_u = m_u_new
        m_s = m_s_new
    out = out_ptr + row * 6
    tl.store(out + 0, m_s * inv_T)
    tl.store(out + 1, tl.sum(l_s, 0))
    tl.store(out + 5, tl.sum(acc_b, 0) * inv_T)
    if HAS_TEACHER:
        tl.store(out + 2, m_u * inv_T)
        tl.store(out + 3, tl.sum(l_u, 0))
        tl.store(out + 4, tl.sum(acc_a, 0) * inv_T)
    else:
        tl.store(out + 2, 0.0)
        tl.store(out + 3, 0.0)
        tl.store(out + 4, 0.0)


_KERNEL = lazy_jit(_kd_row_stats_kernel)


def row_stats(student: torch.Tensor, teacher: torch.Tensor | None, inv_temperature: float,
              block_v: int, num_warps: int, want: str = "ab", num_stages: int = 1) -> torch.Tensor:
    """Per-row statistics `[N, 6]` float32 of this shard (see the module docstring). `want` names
    the teacher sums to compute ("a", "b", both or ""); a column not wanted is written as 0."""
    n_rows, vocab = student.shape
    out = torch.empty((n_rows, NUM_STATS), dtype=torch.float32, device=student.device)
    if n_rows == 0:
        return out
    t = student if teacher is None else teacher
    _KERNEL.get()[(n_rows,)](
        student, t, out, student.stride(0), t.stride(0), vocab, float(inv_temperature),
        float(inv_temperature) * LOG2E.value,
        HAS_TEACHER=teacher is not None, WANT_A="a" in want, WANT_B="b" in want,
        BLOCK_V=block_v, NUM_STAGES=num_stages, num_warps=num_warps,
    )
    return out
