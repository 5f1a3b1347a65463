"""The fused LM-head engines on a GPU at realistic sizes, vs float64 materialised logits (`pytest -m gpu`).

Both CUDA engines: the Triton tiles, and the chunked engine (cuBLAS GEMMs into float32 logits
blocks of all rows x 8192 columns, the Triton row kernels, the block gradient rounded to bf16 once).

N = 2000 tokens, H = 1024, V = 32771 (odd: no multiple of any tile), bf16 and float32 operands, the
dense teacher at H_t = 768, and a top-k 64 teacher; the oracle is `kd_loss(impl="reference")` on
float64 logits `h @ W.T`. Also the memory promise: no [N, V] buffer in forward or backward.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.losses import HiddenTeacher, TopKTeacher, kd_loss, linear_kd_loss
from opkd_mcore.losses.teacher_outputs import DenseTeacher

pytestmark = pytest.mark.gpu

N, H, HT, V = 2000, 1024, 768, 32771


def _inputs(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, H, generator=g, device="cuda").to(dtype)
    w = (torch.randn(V, H, generator=g, device="cuda") * 3 / H ** 0.5).to(dtype)
    ht = torch.randn(N, HT, generator=g, device="cuda").to(dtype)
    wt = (torch.randn(V, HT, generator=g, device="cuda") * 3 / HT ** 0.5).to(dtype)
    return h, w, ht, wt


def _reference(h, w, teacher, weights, **kd):
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    if isinstance(teacher, HiddenTeacher):
        teacher = DenseTeacher(teacher.hidden.double() @ teacher.weight.double().T)
    loss = kd_loss(h64 @ w64.T, teacher, impl="reference", **kd)
    (loss * weights.double()).sum().backward()
    return loss.detach(), h64.grad, w64.grad


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


CASES = [
    (dict(divergence="forward_kl"), "hidden"),
    (dict(divergence="reverse_kl", temperature=1.5), "hidden"),
    (dict(divergence="jsd", beta=0.3), "hidden"),
    (dict(support="union", k=16, divergence="forward_kl", mass="tail", coverage_coef=0.2), "hidden"),
    (dict(support="teacher", divergence="jsd", beta=0.5, mass="tail"), "topk"),
    (dict(support="teacher", divergence="forward_kl", mass="raw"), "topk"),
]


def _engine(name):
    if name in ("tiles", "chunked"):   # the trainer's names (tiles: impl's choice)
        return None if name == "tiles" else name
    from opkd_kernels.linear_kd_chunked import ChunkedLinearKd
    from opkd_kernels.triton_backend import TritonKdBackend

    return ChunkedLinearKd(TritonKdBackend(), block_rows=N, block_cols=8192, gather_elements=1 << 24)


@pytest.mark.parametrize("engine", ["tiles", "chunked", "chunked8k"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kd, kind", CASES, ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else x)
def test_engines_match_float64_materialised_logits(kd, kind, dtype, engine):
    h, w, ht, wt = _inputs(dtype)
    if kind == "hidden":
        teacher = HiddenTeacher(ht, wt)
    else:
        lp, ids = torch.log_softmax(ht.double() @ wt.double().T, -1).topk(64, -1)
        teacher = TopKTeacher(ids, lp.float())
    weights = torch.rand(N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) + 0.5
    ref_loss, ref_dh, ref_dw = _reference(h, w, teacher, weights, **kd)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_kd_loss(hl, wl, teacher, impl="triton", engine=_engine(engine), **kd)
    (loss * weights).sum().backward()
    # float32 logits (registers / blocks): the loss is float32-accurate; bf16 gradients rounded once
    torch.testing.assert_close(loss.double(), ref_loss, atol=2e-4, rtol=1e-4)
    grad_tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    assert _rel(hl.grad, ref_dh) < grad_tol and _rel(wl.grad, ref_dw) < grad_tol


def test_no_logits_sized_buffer():
    """Forward + backward at N x V = 2000 x 32771: extra memory far below one logits buffer."""
    h, w, ht, wt = _inputs(torch.bfloat16)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_kd_loss(hl, wl, HiddenTeacher(ht, wt), impl="triton", divergence="jsd", beta=0.5)
    grads = torch.autograd.grad(loss.sum(), (hl, wl))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
    logits_bytes = N * V * 2
    # dh in float32 [N, H], one dz block of 4096 columns, O(N) statistics, and up to 64 MiB of
    # cuBLAS workspace and transients: below one bf16 logits buffer (131 MB here), let alone the
    # unfused path's three (logits, their gradient, the teacher's logits)
    assert extra < N * H * 4 + N * 4096 * 2 + (64 << 20) < logits_bytes, (extra, logits_bytes)
