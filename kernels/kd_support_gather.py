"""Triton kernel: the logits at each row's support ids on this vocabulary shard, in one launch.

For global ids `[N, K]` (-1 = padding) and this shard's logits `x [N, V_local]` starting at global
id `offset`, writes
    values[n, k] = x[n, ids[n, k] - offset] / T    (float32; 0 where the id is padding or on another shard)
    local[n, k]  = ids[n, k] - offset              (-1 where the id is padding or on another shard)
which the TP all-reduce (SUM) of `values` makes the replicated support values. The torch version
(`fused_kd.support_values`: the shard-local ids, a clamp, a gather, a cast, a scale and a mask)
is ~12 launches over `[N, K]`, whose time does not shrink with TP. Bitwise equal to it: the same
float32 cast of the logit, times the same float32 1/T.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit


def _kd_support_gather_kernel(x_ptr, ids_ptr, val_ptr, local_ptr, n_rows, K, x_rs, x_cs, ids_rs, val_rs,
                              offset, v_local, inv_t, WRITE_LOCAL: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    r2 = rows[:, None]
    c2 = cols[None, :]
    in_blk = (r2 < n_rows) & (c2 < K)
    ids = tl.load(ids_ptr + r2 * ids_rs + c2, mask=in_blk, other=-1).to(tl.int64)
    local = ids - offset
    here = in_blk & (ids >= 0) & (local >= 0) & (local < v_local)
    x = tl.load(x_ptr + r2 * x_rs + tl.where(here, local, 0) * x_cs, mask=here, other=0.0)
    vals = tl.where(here, x.to(tl.float32) * inv_t, 0.0)
    tl.store(val_ptr + r2 * val_rs + c2, vals, mask=in_blk)
    if WRITE_LOCAL:
        tl.store(local_ptr + r2 * K + c2, tl.where(here, local, -1), mask=in_blk)


_KERNEL = lazy_jit(_kd_support_gather_kernel)
ENTRIES_PER_PROGRAM = 1024


def support_gather(x: torch.Tensor, ids: torch.Tensor, offset: int, inv_t: float,
                   with_local: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values `[N, K]` float32, shard-local ids `[N, K]` int64 or None); `x [N, V_local]` (any
    strides), `ids [N, K]` integer global ids."""
    ids = ids.contiguous()
    n_rows, k = ids.shape
    values = torch.empty(n_rows, k, dtype=torch.float32, device=x.device)
    local = torch.empty(n_rows, k, dtype=torch.int64, device=x.device) if with_local else None
    if n_rows == 0 or k == 0:
        return values, local
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(ENTRIES_PER_PROGRAM // block_k, triton.next_power_of_2(n_rows)))
    _KERNEL.get()[(triton.cdiv(n_rows, block_n),)](
        x, ids, values, values if local is None else local, n_rows, k, x.stride(0), x.stride(1),
        ids.stride(0), k, offset, x.shape[1], inv_t, WRITE_LOCAL=with_local, BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return values, local
