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


def _bf16_ulp(x):
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.abs().clamp(min=1e-30))
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def _reference_bf16_logits(h, w, teacher, weights, **kd):
    """`_reference` on student logits rounded to bf16, as the rows engine's cuBLAS GEMMs round them,
    and a per-row bound of a one-ulp disagreement on every student logit: a float32-accumulated GEMM
    lands on the neighbouring bf16 value where the exact product sits near a rounding boundary (its
    summation order depends on the chunk's shape), which moves row n's loss by at most
    sum_i |dL_n/dz_i| ulp(z_i), to first order. The teacher's logits must be exact in bf16
    (`_exact_teacher`): the oracle cannot differentiate through them."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    z = h64 @ w64.T
    z_bf16 = z.detach().bfloat16().double().requires_grad_()
    z = z + (z_bf16 - z.detach())            # the rounded value; gradients reach h and w
    if isinstance(teacher, HiddenTeacher):
        u = teacher.hidden.double() @ teacher.weight.double().T
        assert torch.equal(u, u.bfloat16().double()), "the teacher's logits are not exact in bf16"
        teacher = DenseTeacher(u)
    loss = kd_loss(z, teacher, impl="reference", **kd)
    (loss * weights.double()).sum().backward()
    # rows are independent: d(sum of losses)/d logits holds each row's own gradient
    (dz,) = torch.autograd.grad(kd_loss(z_bf16, teacher, impl="reference", **kd).sum(), [z_bf16])
    return loss.detach(), h64.grad, w64.grad, (dz.abs() * _bf16_ulp(z_bf16.detach())).sum(1)


def _exact_teacher(dtype):
    """Teacher hidden states and weight whose logits are exact in bf16 whatever the GEMM's summation
    order: small integers times 8 entries of +-1/4 per weight row (|u| <= 4 in steps of 1/4)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    ht = torch.randint(-2, 3, (N, HT), generator=g, device="cuda").to(dtype)
    wt = torch.zeros(V, HT, device="cuda")
    cols = torch.rand(V, HT, generator=g, device="cuda").argsort(1)[:, :8]
    signs = torch.randint(0, 2, (V, 8), generator=g, device="cuda") * 2 - 1
    wt.scatter_(1, cols, signs / 4.0)
    return ht, wt.to(dtype)


@pytest.mark.parametrize("chunk_rows", [512, 3000])   # 4 chunks (the last partial) / one chunk past N
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kd, kind", CASES, ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else x)
def test_rows_engine_matches_float64_materialised_logits(kd, kind, dtype, chunk_rows):
    """The rows engine (gradients in the forward, logits in the operands' dtype one chunk of rows at a
    time): float32 against the exact oracle as the other engines; bf16 against the oracle on
    bf16-rounded logits (its logits are rounded once, like an unfused bf16 logits buffer), each row
    within one bf16 ulp of disagreement on its logits (`_reference_bf16_logits`); the dense teacher's
    logits exact in bf16 (`_exact_teacher`)."""
    from opkd_mcore.losses.fused_linear import linear_kd_loss_weighted

    h, w, ht, wt = _inputs(dtype)
    if kind == "hidden":
        teacher = HiddenTeacher(*_exact_teacher(dtype))
    else:
        lp, ids = torch.log_softmax(ht.double() @ wt.double().T, -1).topk(64, -1)
        teacher = TopKTeacher(ids, lp.float())
    weights = torch.rand(N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) + 0.5
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    scalar, loss, stats = linear_kd_loss_weighted(hl, wl, teacher, weights, impl="triton",
                                                  chunk_rows=chunk_rows, **kd)
    scalar.backward()
    if kind == "hidden":   # exact logits in steps of 1/4: many tied maxima, the first column wins
        u = teacher.hidden.double() @ teacher.weight.double().T
        assert torch.equal(stats.teacher_top1, u.argmax(1))
    if dtype == torch.float32:
        ref_loss, ref_dh, ref_dw = _reference(h, w, teacher, weights, **kd)
        row_tol, grad_tol = 2e-4 + 1e-4 * ref_loss.abs(), 2e-4
    else:
        ref_loss, ref_dh, ref_dw, bound = _reference_bf16_logits(h, w, teacher, weights, **kd)
        row_tol, grad_tol = bound + 1e-4 + 1e-4 * ref_loss.abs(), 2e-2
    excess = (loss.double() - ref_loss).abs() - row_tol
    assert excess.max() <= 0, f"row {excess.argmax().item()}: {loss[excess.argmax()].item()} vs {ref_loss[excess.argmax()].item()}"
    assert abs(scalar.double() - (weights.double() * ref_loss).sum()) <= (weights.double() * row_tol).sum()
    assert _rel(hl.grad, ref_dh) < grad_tol and _rel(wl.grad, ref_dw) < grad_tol
