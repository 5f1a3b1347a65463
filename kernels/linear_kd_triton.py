"""The fused LM-head loss on Triton tiles (CUDA, or CPU under TRITON_INTERPRET=1).

    row_stats    linear_kd_row_stats.py: one launch, logits tiles never leave the chip
    jsd_sums     linear_kd_jsd_sums.py: JSD only, a second tile pass
    support      linear_kd_gather.py: h . W[id] at K ids per row (sparse supports)
    gradient     per vocabulary block of `grad_block_cols` columns (all rows when they fit
                 `grad_block_bytes`): linear_kd_grad.py writes dz, kd_sparse_scatter.py puts the
                 support entries in, then two cuBLAS GEMMs (dh += dz W in float32, dW = dz^T h)
    top-k        (dense teacher with a sparse support only) materialised blocks, in torch

Extra memory: one dz block (bf16, 128 MiB by default at N = 16384) + dh in float32 [N, H];
O(N) statistics otherwise. Launch shapes: `LinearTileConfig`, or OPKD_LINEAR_KD_TILES=
"BLOCK_N,BLOCK_V,BLOCK_K,WARPS,STAGES" and OPKD_LINEAR_KD_GRAD_COLS for sweeps.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from . import kd_sparse_scatter
from ._jit import interpreting
from .fused_kd import merge_stats
from .linear_kd_common import LinearInputs, block_topk
from .linear_kd_gather import gather_logits
from .linear_kd_grad import linear_grad_block
from .linear_kd_jsd_sums import linear_jsd_sums
from .linear_kd_row_stats import linear_row_stats
from .triton_backend import TritonKdBackend


@dataclass(frozen=True)
class LinearTileConfig:
    """Tile shapes. 128 x 128 x 64, 8 warps, 3 stages: a plain bf16 GEMM tile on H100/H200 that
    leaves registers for the second (teacher) accumulator of the dense case."""

    block_n: int = 128           # rows per tile
    block_v: int = 128           # vocabulary columns per tile
    block_k: int = 64            # hidden entries per tl.dot step
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8             # row tiles that share W tiles in L2 (gradient kernel)
    num_splits: int | None = None   # vocabulary splits of the stats pass; None: fill the device
    grad_block_cols: int = 4096  # vocabulary columns of one dz block
    grad_block_bytes: int = 128 << 20   # dz block budget; rows are chunked beyond it


def default_config() -> LinearTileConfig:
    if interpreting():
        # numpy per tile: 16 is tl.dot's smallest shape; small dz blocks exercise the block loops
        return LinearTileConfig(16, 16, 16, 1, 1, 2, num_splits=2, grad_block_cols=32, grad_block_bytes=2048)
    cfg = LinearTileConfig()
    env = os.environ.get("OPKD_LINEAR_KD_TILES")
    if env:
        bn, bv, bk, warps, stages = (int(x) for x in env.split(","))
        cfg = replace(cfg, block_n=bn, block_v=bv, block_k=bk, num_warps=warps, num_stages=stages)
    if os.environ.get("OPKD_LINEAR_KD_GRAD_COLS"):
        cfg = replace(cfg, grad_block_cols=int(os.environ["OPKD_LINEAR_KD_GRAD_COLS"]))
    return cfg


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class TritonLinearKd:
    """Engine of the fused LM-head loss on Triton tiles (see the module docstring)."""

    name = "triton"

    def __init__(self, config: LinearTileConfig | None = None):
        self.cfg = config or default_config()
        self.sparse_backend = TritonKdBackend()   # one-launch sparse objective on [N, K]

    def _splits(self, n: int, v: int, device) -> int:
        c = self.cfg
        if c.num_splits is not None:
            return c.num_splits
        row_tiles = -(-n // c.block_n)
        want = -(-4 * _num_sms(device) // row_tiles)      # ~4 programs per SM
        return max(1, min(want, -(-v // c.block_v)))

    def _tiles(self, x):
        c = self.cfg
        # float32 operands take twice the shared memory per stage: halve the K step to stay in it
        block_k = max(16, c.block_k // 2) if x.dtype == torch.float32 and not interpreting() else c.block_k
        return dict(block_n=c.block_n, block_v=c.block_v, block_k=block_k, num_warps=c.num_warps,
                    num_stages=c.num_stages)

    def row_stats(self, inp: LinearInputs, inv_t: float, want_argmax: bool = False):
        splits = self._splits(inp.num_rows, inp.vocab, inp.hidden.device)
        parts, arg = linear_row_stats(inp.hidden, inp.weight, inp.teacher_hidden, inp.teacher_weight,
                                      inp.student_end, inp.teacher_end, inv_t, splits,
                                      **self._tiles(inp.hidden))
        stats = merge_stats(parts.transpose(0, 1))
        argmax = None
        if want_argmax and inp.teacher_hidden is not None:
            # the split holding the row's teacher maximum has its column (first split on a tie)
            argmax = arg.gather(1, parts[:, :, 2].argmax(dim=1, keepdim=True))[:, 0].long()
        return stats, argmax

    def jsd_sums(self, inp: LinearInputs, lse, inv_t: float, beta: float):
        splits = self._splits(inp.num_rows, inp.vocab, inp.hidden.device)
        return linear_jsd_sums(inp.hidden, inp.weight, inp.teacher_hidden, inp.teacher_weight, lse,
                               inp.student_end, inp.teacher_end, inv_t, beta, splits,
                               **self._tiles(inp.hidden)).sum(dim=1)

    def support_values(self, x, w, local_ids, end: int):
        return gather_logits(x, w, local_ids, end)

    def topk(self, x, w, k: int, end: int):
        rows, cols = self.grad_shape(x.shape[0], w.shape[0])
        return block_topk(x, w, k, end, rows, cols)

    def grad_shape(self, n: int, v: int) -> tuple[int, int]:
        cols = min(v, self.cfg.grad_block_cols)
        rows = max(self.cfg.block_n, self.cfg.grad_block_bytes // (2 * max(cols, 1)))
        return min(n, rows) or 1, max(cols, 1)

    def grad_block(self, inp: LinearInputs, rows: slice, cols: slice, lse, coef, inv_t: float,
                   beta: float, code: int):
        teacher = code != 0 and inp.teacher_hidden is not None
        return linear_grad_block(
            inp.hidden[rows], inp.weight[cols], inp.teacher_hidden[rows] if teacher else None,
            inp.teacher_weight[cols] if teacher else None, lse, coef, inp.student_end - cols.start,
            inp.teacher_end - cols.start, inv_t, beta, code, group_m=self.cfg.group_m,
            **self._tiles(inp.hidden))

    def scatter(self, dz, local_ids, s_support, d_support, lse, coef):
        return kd_sparse_scatter.sparse_scatter(dz, local_ids, s_support, d_support, lse, coef)
