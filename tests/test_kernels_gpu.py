"""Fused KD kernels at real sizes on GPU (`-m gpu`): TP=1 and TP=2 over NCCL, against the reference path.

The oracle here is `kd_loss(impl="reference")` in float64 on the same device (itself checked
against the float64 brute force on CPU); the brute force is too slow for a 152K vocabulary.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss
from opkd_mcore.losses.fused import fused_kd_loss_or_none
from tests._dist import run_distributed

pytestmark = pytest.mark.gpu

N, V = 384, 151936
CASES = [
    dict(divergence="forward_kl"),
    dict(divergence="reverse_kl", temperature=1.5),
    dict(divergence="jsd", beta=0.4),
    dict(support="teacher", divergence="forward_kl", mass="renorm"),
    dict(support="teacher", divergence="forward_kl", mass="tail", coverage_coef=0.5),
    dict(support="teacher", divergence="forward_kl", mass="raw"),
    dict(support="teacher", divergence="jsd", beta=0.3, mass="tail"),
    dict(support="union", k=64, divergence="reverse_kl", mass="renorm", dense=True),
]
# (loss atol, grad atol): bf16 gradients carry bf16 rounding of values up to ~1/V_eff
TOL = {torch.float32: (1e-4, 1e-6), torch.bfloat16: (1e-3, 2e-3)}


def _inputs(device, dtype, kd, vocab=V, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    z = (torch.randn(N, vocab, generator=g, device=device) * 2).to(dtype)
    t = torch.randn(N, vocab, generator=g, device=device) * 2
    if kd.get("support") is None or kd.get("dense"):
        return z, DenseTeacher(t.to(dtype))
    top = torch.log_softmax(t, dim=-1).topk(256, dim=-1)
    ids, logprobs = top.indices, top.values
    ids[::7, 100:], logprobs[::7, 100:] = -1, float("-inf")     # padded rows
    return z, TopKTeacher(ids, logprobs)


def _kd(kd):
    return {k: v for k, v in kd.items() if k != "dense"}


def _reference(z, teacher, weights, kd, group=None):
    leaf = z.double().requires_grad_()
    if isinstance(teacher, DenseTeacher):
        teacher = DenseTeacher(teacher.logits.double())
    loss = kd_loss(leaf, teacher, impl="reference", tp_group=group, **_kd(kd))
    (loss * weights).sum().backward()
    return loss.detach(), leaf.grad


def _fused(z, teacher, weights, kd, group=None):
    logits = z.clone().requires_grad_()
    loss = fused_kd_loss_or_none(logits, teacher, tp_group=group, **_kd(kd))
    assert loss is not None
    (loss * weights.float()).sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kd", CASES, ids=lambda kd: "-".join(map(str, kd.values())))
def test_fused_matches_reference_tp1(kd, dtype):
    z, teacher = _inputs("cuda", dtype, kd)
    weights = torch.rand(N, device="cuda", dtype=torch.float64) + 0.5
    ref_loss, ref_grad = _reference(z, teacher, weights, kd)
    loss, grad = _fused(z, teacher, weights, kd)
    la, ga = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref_loss, atol=la, rtol=1e-3)
    torch.testing.assert_close(grad.double(), ref_grad, atol=ga, rtol=2e-2)


def test_dispatch_goes_to_fused_kernels_on_cuda():
    z, teacher = _inputs("cuda", torch.bfloat16, dict(divergence="forward_kl"))
    auto = kd_loss(z, teacher, impl="auto")
    fused = kd_loss(z, teacher, impl="fused")
    torch.testing.assert_close(auto, fused, atol=0, rtol=0)


@pytest.mark.parametrize("kd", CASES, ids=lambda kd: "-".join(map(str, kd.values())))
def test_fused_forward_and_backward_never_sync_the_host(kd):
    """The CPU test (tests/test_kernels_no_host_sync.py) checks the ops; this checks CUDA itself:
    any synchronising call between the first launch and the gradient raises."""
    z, teacher = _inputs("cuda", torch.bfloat16, kd)
    weights = torch.rand(N, device="cuda") + 0.5
    logits = z.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fused_kd_loss_or_none(logits, teacher, **_kd(kd))
        (loss * weights).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.grad is not None and loss.shape == (N,)


def _tp2_worker(rank, world):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    out = []
    for kd in CASES:
        z, teacher = _inputs("cuda", torch.bfloat16, kd, seed=3)   # identical full tensors on both ranks
        weights = torch.rand(N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1),
                             dtype=torch.float64) + 0.5
        ref_loss, ref_grad = _reference(z, teacher, weights, kd)      # TP=1 on the full vocabulary
        v_local = V // world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        local_teacher = DenseTeacher(teacher.logits[:, shard].contiguous()) if isinstance(teacher, DenseTeacher) \
            else teacher
        loss, grad = _fused(z[:, shard].contiguous(), local_teacher, weights, kd, group=group)
        la, ga = TOL[torch.bfloat16]
        torch.testing.assert_close(loss.double(), ref_loss, atol=la, rtol=1e-3)
        torch.testing.assert_close(grad.double(), ref_grad[:, shard], atol=ga, rtol=2e-2)
        out.append(loss.tolist())
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fused_tp2_over_nccl_matches_tp1():
    per_rank = run_distributed(_tp2_worker, 2, env={"NCCL_NVLS_ENABLE": "0",
                                                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    assert per_rank[0] == per_rank[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scale_kernel_rounds_like_a_float32_product(dtype):
    """The rows engine's in-place gradient scaling: float32 product, rounded once (several blocks)."""
    from opkd_kernels.kd_scale import scale_

    x = torch.randn(1237, 4099, device="cuda").to(dtype)
    g = torch.tensor(0.37, device="cuda")
    assert torch.equal(scale_(x.clone(), g), (x.float() * g).to(dtype))
