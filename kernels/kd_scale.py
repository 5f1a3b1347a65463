"""Triton kernel: `x *= g` in place, `g` a float32 scalar read on the device (no host sync).

The rows engine hands out gradients computed in its forward, scaled by the incoming gradient of its
scalar. torch's `x.mul_(g)` with a 0-dim float32 tensor takes the generic elementwise path, not the
vectorised one (the scalar is a broadcast operand): ~1.5 ms per call on the [151936, 4096] bf16
weight gradient on an H200, about twice the copy rate's time. Half-precision `x` is scaled in float32
and rounded once, as `mul_` does (bit for bit on a GPU; the interpreter's float32 -> bf16 conversion
truncates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import lazy_jit

BLOCK = 4096


def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr)
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=mask)


_KERNEL = lazy_jit(_scale_kernel)


def scale_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`x *= g` for a contiguous float32 / bf16 / fp16 `x` and a 0-dim float32 `g` on its device;
    other tensors take `x.mul_(g)`. Returns `x`."""
    if not (x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and g.dtype == torch.float32 and g.numel() == 1):
        return x.mul_(g)
    if x.numel():
        _KERNEL.get()[(triton.cdiv(x.numel(), BLOCK),)](x, g, x.numel(), BLOCK=BLOCK, num_warps=8)
    return x
