"""Triton kernel: put the support-set part of the gradient at the K sparse ids of each row.

After `kd_grad` wrote c0 q_j everywhere, each in-shard support id j of row n gets
    g[n, j] = c0[n] exp(s_j - lse_s[n]) + d[n, k]        (d = d loss / d s_S, already scaled)
computed in float32 and stored once (a masked store, so off-shard or padding ids touch nothing:
no dummy index that could collide with a real id 0). Ids must be unique within a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit


def _kd_sparse_scatter_kernel(g_ptr, ids_ptr, s_ptr, d_ptr, lse_ptr, coef_ptr, g_stride, V, K,
                              BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    in_row = k < K
    ids = tl.load(ids_ptr + row * K + k, mask=in_row, other=-1)
    valid = in_row & (ids >= 0) & (ids < V)
    s = tl.load(s_ptr + row * K + k, mask=valid, other=0.0)
    d = tl.load(d_ptr + row * K + k, mask=valid, other=0.0)
    lse_s = tl.load(lse_ptr + row * 2)
    c0 = tl.load(coef_ptr + row * 2)
    val = c0 * tl.exp(s - lse_s) + d
    safe_ids = tl.where(valid, ids, 0)
    tl.store(g_ptr + row * g_stride + safe_ids, val.to(g_ptr.dtype.element_ty), mask=valid)


_KERNEL = lazy_jit(_kd_sparse_scatter_kernel)


def sparse_scatter(out: torch.Tensor, local_ids: torch.Tensor, s_support: torch.Tensor,
                   d_support: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """`local_ids [N, K]` int64 (shard-local; < 0 or >= V_local = not here); float32 `[N, K]` rest."""
    n_rows, vocab = out.shape
    k = local_ids.shape[1]
    if n_rows == 0 or k == 0:
        return out
    _KERNEL.get()[(n_rows,)](
        out, local_ids.contiguous(), s_support.contiguous(), d_support.contiguous(), lse, coef,
        out.stride(0), vocab, k, BLOCK_K=triton.next_power_of_2(k),
    )
    return out
