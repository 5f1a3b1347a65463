"""The fused LM-head loss, chunked torch twin: logits exist one [R, C] block at a time.

For CPU and devices without Triton (Ascend NPU). Each block of logits `x[rows] @ w[cols].T` is
materialised in float32 by a matmul and handed to the four fused-KD primitives of a logits backend
(the C++ twin `cpu_backend.CppKdBackend` on CPU, `torch_backend.TorchKdBackend` elsewhere) — the
same primitives, formulas and tests as the logits kernels:

    row stats   per block: backend.row_stats -> [R, 6]; blocks of a row merged by `merge_stats`
    JSD sums    per block: backend.jsd_sums -> [R, 2]; summed
    gradient    per block: backend.write_grad (in place into the block), backend.sparse_scatter
    support     s_S[n, k] = x[n] . w[id_k]: rows of w gathered for a few tokens at a time

Memory: one block of student logits and one of teacher logits (`block_rows x block_cols`
float32 each), plus `[block_rows, K, H]` gathered weight rows for a sparse support; never
[N, V]. The driver (`fused_linear_kd.py`) does the TP collectives and the dH / dW products.
"""
from __future__ import annotations

import torch

from .fused_kd import merge_stats
from .linear_kd_common import PAD_LOGIT, LinearInputs, block_topk, compute_dtype, logits_block, row_blocks

# Gathered weight rows per support_values step, in elements (float32: 16 MiB).
GATHER_ELEMENTS = 1 << 22


class ChunkedLinearKd:
    """Engine of the fused LM-head loss over materialised blocks (see the module docstring)."""

    def __init__(self, backend, block_rows: int = 1024, block_cols: int = 4096, *,
                 gather_elements: int = GATHER_ELEMENTS):
        if block_rows < 1 or block_cols < 1:
            raise ValueError(f"block_rows / block_cols: expected >= 1, got {block_rows} / {block_cols}")
        self.backend = backend
        self.block_rows, self.block_cols = block_rows, block_cols
        self.gather_elements = gather_elements   # weight rows gathered per support_values step
        self.name = f"chunked-{backend.name}"
        # the objective on [N, K] support tensors: the torch version (a backend may bring its own)
        self.sparse_backend = backend

    def _blocks(self, inp: LinearInputs, rows: slice, cols: slice, teacher: bool):
        cd = compute_dtype(inp.hidden)
        z = logits_block(inp.hidden, inp.weight, rows, cols, inp.student_end, cd)
        if not teacher:
            return z, None
        return z, logits_block(inp.teacher_hidden, inp.teacher_weight, rows, cols, inp.teacher_end, cd)

    # ------------------------------------------------------------------ forward
    def row_stats(self, inp: LinearInputs, inv_t: float, want_argmax: bool = False):
        """Shard stats `[N, 6]` (see kd_row_stats.py) and the teacher's shard-local argmax `[N]`
        (None without a dense teacher or when not wanted)."""
        n, dense = inp.num_rows, inp.teacher_hidden is not None
        out = torch.empty(n, 6, dtype=torch.float32, device=inp.hidden.device)
        argmax = (torch.zeros(n, dtype=torch.int64, device=inp.hidden.device) if dense and want_argmax
                  else None)
        for rows in row_blocks(n, self.block_rows):
            parts = []
            best = None
            for cols in row_blocks(inp.vocab, self.block_cols):
                z, u = self._blocks(inp, rows, cols, dense)
                parts.append(self.backend.row_stats(z, u, inv_t).float())
                if argmax is not None:
                    val, idx = u.max(dim=1)
                    if best is None:
                        best, argmax[rows] = val, idx + cols.start
                    else:   # strictly greater: the first column wins a tie, like torch.max
                        better = val > best
                        best = torch.where(better, val, best)
                        argmax[rows] = torch.where(better, idx + cols.start, argmax[rows])
            out[rows] = merge_stats(torch.stack(parts))
        return out, argmax

    def jsd_sums(self, inp: LinearInputs, lse: torch.Tensor, inv_t: float, beta: float) -> torch.Tensor:
        out = torch.zeros(inp.num_rows, 2, dtype=torch.float32, device=inp.hidden.device)
        for rows in row_blocks(inp.num_rows, self.block_rows):
            for cols in row_blocks(inp.vocab, self.block_cols):
                z, u = self._blocks(inp, rows, cols, True)
                out[rows] += self.backend.jsd_sums(z, u, lse[rows].contiguous(), inv_t, beta).float()
        return out

    def support_values(self, x: torch.Tensor, w: torch.Tensor, local_ids: torch.Tensor,
                       end: int) -> torch.Tensor:
        """Raw logits `x[n] . w[id]` at shard-local ids `[N, K]` (float32; 0 where id < 0)."""
        n, k = local_ids.shape
        out = torch.zeros(n, k, dtype=torch.float32, device=x.device)
        if n == 0 or k == 0:
            return out
        cd = compute_dtype(x)
        step = max(1, self.gather_elements // max(1, k * x.shape[1]))
        for rows in row_blocks(n, step):
            ids = local_ids[rows]
            rows_w = w[ids.clamp(min=0)].to(cd)                          # [r, K, H]
            vals = torch.bmm(rows_w, x[rows].to(cd)[:, :, None])[:, :, 0]
            vals = torch.where(ids >= end, PAD_LOGIT, vals)
            out[rows] = torch.where(ids >= 0, vals, 0.0).float()
        return out

    def topk(self, x: torch.Tensor, w: torch.Tensor, k: int, end: int):
        return block_topk(x, w, k, end, self.block_rows, self.block_cols)

    # ------------------------------------------------------------------ backward
    def grad_shape(self, n: int, v: int) -> tuple[int, int]:
        return self.block_rows, self.block_cols

    def grad_block(self, inp: LinearInputs, rows: slice, cols: slice, lse, coef, inv_t: float,
                   beta: float, code: int) -> torch.Tensor:
        """d loss / d logits of one block `[R, C]` (float32), written over the block's own logits."""
        z, u = self._blocks(inp, rows, cols, code != 0)
        return self.backend.write_grad(z, u, z, lse, coef, inv_t, beta, code)

    def scatter(self, dz, local_ids, s_support, d_support, lse, coef):
        return self.backend.sparse_scatter(dz, local_ids, s_support, d_support, lse, coef)
