"""Triton kernel: logits at K support ids per row, without forming the row's logits.

    out[n, k] = h[n] . W[id[n, k]]     (float32 accumulation of the operands' exact products)
for shard-local ids; 0 where id < 0 (padding, or the id lives on another TP shard: the caller's
SUM all-reduce fills it in), PAD_LOGIT where id >= `end` (vocabulary padding). A program reads one
row of h and BLOCK_K gathered rows of W, BLOCK_H hidden entries at a time: N K H reads of W in all
(bandwidth-bound; for K = 256 a few % of the fused loss's GEMM time at realistic sizes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit
from .linear_kd_common import PAD_LOGIT

_PAD = tl.constexpr(PAD_LOGIT)


def _linear_kd_gather_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, K, H, x_rs, w_rs, end,
                             BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < K
    ids = tl.load(ids_ptr + row * K + kk, mask=k_ok, other=-1)
    valid = k_ok & (ids >= 0)
    safe = tl.where(valid, ids, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < H
        xv = tl.load(x_ptr + row * x_rs + hh, mask=h_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + safe[:, None] * w_rs + hh[None, :], mask=valid[:, None] & h_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], 1)
    acc = tl.where(ids >= end, _PAD, acc)
    tl.store(out_ptr + row * K + kk, tl.where(valid, acc, 0.0), mask=k_ok)


_KERNEL = lazy_jit(_linear_kd_gather_kernel)


def gather_logits(x: torch.Tensor, w: torch.Tensor, local_ids: torch.Tensor, end: int,
                  block_k: int = 32, block_h: int = 128) -> torch.Tensor:
    """`[N, K]` float32 raw logits at shard-local ids (see the module docstring)."""
    n, k = local_ids.shape
    out = torch.empty((n, k), dtype=torch.float32, device=x.device)
    if n == 0 or k == 0:
        return out
    ids = local_ids.contiguous()
    grid = (n, triton.cdiv(k, block_k))
    _KERNEL.get()[grid](x, w, ids, out, k, x.shape[1], x.stride(0), w.stride(0), end,
                        BLOCK_K=block_k, BLOCK_H=block_h)
    return out
