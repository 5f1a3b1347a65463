"""Pieces shared by the two engines of the fused LM-head loss (chunked torch twin, Triton tiles).

Shape legend: N tokens, H / H_t student / teacher hidden sizes, V this rank's vocabulary shard
(`V_local`), R x C one block of logits (rows x vocabulary columns), K support ids per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Logit of a vocabulary-padding column (ids past the real vocabulary on the last TP shard), in the
# fused kernels and in the logits the trainer materialises alike (the trainer imports it from here:
# kernels import nothing of the trainer). exp() of it underflows to exactly 0 in every float dtype,
# yet it stays finite after division by any sane temperature, so 0 * log-terms never become NaN.
PAD_LOGIT = -1.0e4


@dataclass(frozen=True)
class LinearInputs:
    """The operands of one fused LM-head loss call on this rank.

    Logits are `z = hidden @ weight.T` (student) and `u = teacher_hidden @ teacher_weight.T`
    (dense teacher); columns at or past `student_end` / `teacher_end` are vocabulary padding and
    get the logit `PAD_LOGIT` (they are constants: no gradient reaches their weight rows).
    """

    hidden: torch.Tensor                    # [N, H]
    weight: torch.Tensor                    # [V, H]
    teacher_hidden: torch.Tensor | None     # [N, H_t]
    teacher_weight: torch.Tensor | None     # [V, H_t]
    student_end: int
    teacher_end: int

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 operands keep float64 math; everything else is accumulated in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def matmul_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b.T` with `out_dtype` results. Half-precision operands stay half on a GPU (tensor
    cores, float32 accumulation, one rounding) and are upcast elsewhere (CPU matmuls)."""
    if a.dtype == out_dtype:
        return a @ b.T
    if a.is_cuda and out_dtype == torch.float32:
        try:
            return torch.mm(a, b.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):   # a torch without mm(out_dtype=)
            pass
    return a.to(out_dtype) @ b.to(out_dtype).T


def logits_block(x: torch.Tensor, w: torch.Tensor, rows: slice, cols: slice, end: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """Logits `[R, C]` of rows x columns in `dtype`, vocabulary padding set to `PAD_LOGIT`."""
    z = matmul_nt(x[rows], w[cols], dtype)
    if end < cols.stop:
        z[:, max(end - cols.start, 0):] = PAD_LOGIT
    return z


def row_blocks(n: int, size: int):
    return [slice(lo, min(n, lo + size)) for lo in range(0, n, max(1, size))]


@torch.no_grad()
def block_topk(x: torch.Tensor, w: torch.Tensor, k: int, end: int, block_rows: int,
               block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k of `x @ w.T` over this shard, one block of logits at a time.

    Returns float32 values and shard-local column ids `[N, min(k, V)]` (the caller adds the shard
    offset and merges over the TP group). Per row block: top-k of each column block, then the top-k
    of those candidates, so at most one block of logits exists at a time.
    """
    n, v = x.shape[0], w.shape[0]
    k_local = min(k, v)
    vals = torch.empty(n, k_local, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, k_local, dtype=torch.int64, device=x.device)
    for rows in row_blocks(n, block_rows):
        cand_v, cand_i = [], []
        for cols in row_blocks(v, block_cols):
            z = logits_block(x, w, rows, cols, end, torch.float32)
            top = z.topk(min(k_local, z.shape[1]), dim=1)
            cand_v.append(top.values)
            cand_i.append(top.indices + cols.start)
        cv, ci = torch.cat(cand_v, dim=1), torch.cat(cand_i, dim=1)
        best = cv.topk(k_local, dim=1).indices
        vals[rows], ids[rows] = cv.gather(1, best), ci.gather(1, best)
    return vals, ids


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b` with a float32 (or float64) accumulator and operands of any float dtype."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and acc.dtype == torch.float32:
        try:   # cuBLAS: half operands, float32 C read and written once (no rounded partials)
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):
            pass
    if a.is_cuda:
        acc.add_(a @ b)
        return
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
