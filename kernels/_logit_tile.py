"""The logit tile of the fused LM-head kernels: one `[BLOCK_N, BLOCK_V]` block of `h W^T / T`.

The three tile kernels (`linear_kd_row_stats.py`, `linear_kd_grad.py`, `linear_kd_jsd_sums.py`)
form every block of student logits (and of dense-teacher logits) here: a loop over the hidden
dimension in BLOCK_K steps of `tl.dot` (operands in `DOT_DTYPE`, float32 accumulation), then the
temperature and the vocabulary padding, as the chunked torch twin's `logits_block` does:

    z[r, c] = sum_k h[rows[r], k] W[cols[c], k] / T      for cols[c] <  end
    z[r, c] = PAD_LOGIT / T                             for cols[c] >= end   (vocabulary padding)

Rows and columns outside the operands (`row_ok` / `col_ok` false) read zeros: their entries are
the padding logit or 0, and the calling kernel masks them as its own reduction needs. A jit
helper is inlined into each kernel, so the compiled kernels are the ones a copy of this loop in
each would give.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._jit import interpreting, lazy_jit
from .linear_kd_common import PAD_LOGIT

_PAD = tl.constexpr(PAD_LOGIT)


def dot_operands(x: torch.Tensor):
    """(operand dtype, input precision) of the tile kernels' tl.dot for operands like `x`.

    float32 operands get IEEE products (TF32 would cost ~1e-3 relative in every logit); half
    precision operands are exact products either way. The interpreter's tl.dot mishandles bf16
    (raw bits as integers, Triton 3.6), so there the tiles are upcast: the same exact products."""
    dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]
    if interpreting():
        dtype = tl.float32
    return dtype, "ieee" if x.dtype == torch.float32 else "tf32"   # tf32: the default, moot for halves


def _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, x_rs, w_rs, end, inv_T,
                DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 `[BLOCK_N, BLOCK_V]` logits of rows `rows` (int64) x columns `cols` (see the module
    docstring); `x_rs` / `w_rs`: row strides of `x [N, H]` and `w [V, H]`."""
    ks = tl.arange(0, BLOCK_K)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        a_t = tl.load(x_ptr + rows[:, None] * x_rs + k[None, :],
                      mask=row_ok[:, None] & (k[None, :] < H), other=0.0).to(DOT_DTYPE)
        b_t = tl.load(w_ptr + cols64[None, :] * w_rs + k[:, None],
                      mask=col_ok[None, :] & (k[:, None] < H), other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a_t, b_t, acc, input_precision=DOT_PRECISION)
    return tl.where(cols[None, :] < end, acc * inv_T, _PAD * inv_T)


logit_tile = lazy_jit(_logit_tile)
