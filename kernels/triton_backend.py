"""The Triton implementation of the four fused-KD primitives (CUDA, or CPU under TRITON_INTERPRET=1)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import (kd_grad, kd_jsd_sums, kd_row_stats, kd_scale, kd_sparse_objective, kd_sparse_scatter,
               kd_support_gather)
from ._jit import interpreting


@dataclass(frozen=True)
class TritonLaunch:
    """Launch shape. block_v: vocab entries per loop step of a row; num_warps: warps per row;
    num_stages: blocks of the row whose loads are in flight at once (`tl.range` pipelining).
    1024 x 4 was the best of a sweep on H200 (bf16, V = 151936, with the per-row-max stats pass),
    2% ahead of 2048 x 8 and 5-10% ahead of 512 x 2-4, 2048 x 4 and 1024 x 2 / 8. Three stages:
    dense forward KL 9.35 -> 8.66 ms on an H100 at 16384 x 151936 (52.9 -> 57.1% of copy), JSD and
    top-k 256 1%; 4 stages the same, 2 half of it."""

    block_v: int = 1024
    num_warps: int = 4
    num_stages: int = 3


def _default_launch(vocab: int) -> TritonLaunch:
    env = os.environ.get("OPKD_TRITON_LAUNCH")   # "BLOCK_V,NUM_WARPS[,NUM_STAGES]", for launch sweeps
    if env:
        return TritonLaunch(*(int(x) for x in env.split(",")))
    if interpreting():
        # The interpreter runs numpy per block: small blocks keep tiny test shapes multi-step.
        return TritonLaunch(block_v=32, num_warps=1)
    return TritonLaunch()


class TritonKdBackend:
    """Row-parallel Triton kernels; every primitive takes `[N, V_local]` rows with unit stride."""

    name = "triton"
    writes_teacher_top1 = True   # write_grad(..., teacher_top1=) fills it in the same pass

    def __init__(self, launch: TritonLaunch | None = None):
        self._launch = launch

    def _cfg(self, vocab: int) -> TritonLaunch:
        return self._launch or _default_launch(vocab)

    def row_stats(self, student, teacher, inv_t, want="ab"):
        c = self._cfg(student.shape[1])
        return kd_row_stats.row_stats(student, teacher, inv_t, c.block_v, c.num_warps, want, c.num_stages)

    def jsd_sums(self, student, teacher, lse, inv_t, beta):
        c = self._cfg(student.shape[1])
        return kd_jsd_sums.jsd_sums(student, teacher, lse, inv_t, beta, c.block_v, c.num_warps, c.num_stages)

    def write_grad(self, student, teacher, out, lse, coef, inv_t, beta, code, teacher_top1=None):
        c = self._cfg(student.shape[1])
        return kd_grad.write_grad(student, teacher, out, lse, coef, inv_t, beta, code, c.block_v, c.num_warps,
                                  teacher_top1, c.num_stages)

    def scale_(self, x, g):
        """`x *= g` (0-dim float32 `g` on the device), vectorised; see `kd_scale`."""
        return kd_scale.scale_(x, g)

    def sparse_scatter(self, out, local_ids, s_support, d_support, lse, coef):
        return kd_sparse_scatter.sparse_scatter(out, local_ids, s_support, d_support, lse, coef)

    def support_gather(self, x, ids, offset, inv_t, with_local=True):
        """`fused_kd.support_values` in one launch: (x / T at the support ids on this shard, local ids)."""
        return kd_support_gather.support_gather(x, ids, offset, inv_t, with_local)

    def sparse_objective(self, s_S, lse, log_p_S, valid, kind, beta, mass, coverage_coef, need_grad):
        """`sparse_objective.sparse_objective_and_grads` and the support masses in one launch
        (float64 in registers): (loss, dL/ds_S, dL/dlse, teacher mass on S, student mass on S)."""
        return kd_sparse_objective.sparse_objective(s_S, lse, log_p_S, valid, kind, beta, mass, coverage_coef,
                                                    need_grad)


def triton_usable_on(t: torch.Tensor) -> bool:
    """Compiled kernels need a CUDA tensor; the interpreter takes CPU tensors."""
    return t.device.type == "cuda" or (interpreting() and t.device.type == "cpu")
