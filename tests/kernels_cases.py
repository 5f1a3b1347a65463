"""Shared cases for the fused-kernel tests: inputs, and a check against the float64 brute force.

Used by tests/test_kernels_*.py for both backends (Triton under TRITON_INTERPRET=1, and the C++
twin). The oracle is `tests.losses_reference.reference_kd_loss` (independent float64 autograd).
"""
from __future__ import annotations

import torch

from opkd_mcore.losses import DenseTeacher, TopKTeacher
from opkd_mcore.losses.fused import fused_kd_loss_or_none
from tests.losses_reference import reference_kd_loss

# (loss atol, grad atol) per input dtype; bf16 inputs are compared on the bf16-rounded values,
# so only the kernels' float32 accumulation and the bf16 rounding of the gradient remain.
TOLERANCE = {torch.float32: (2e-5, 2e-6), torch.bfloat16: (2e-4, 4e-3)}


def make_logits(n: int, vocab: int, seed: int, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale,
            torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale)


def make_topk(teacher_logits: torch.Tensor, k: int) -> TopKTeacher:
    """Teacher top-k with edge cases: row 1 half padding, row 2 all padding (id -1, logprob -inf)."""
    top = torch.log_softmax(teacher_logits, dim=-1).topk(k, dim=-1)
    ids, logprobs = top.indices.clone(), top.values.float().clone()
    ids[1, k // 2:], logprobs[1, k // 2:] = -1, float("-inf")
    ids[2, :], logprobs[2, :] = -1, float("-inf")
    # order inside a row must not matter
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    return TopKTeacher(ids[:, perm].contiguous(), logprobs[:, perm].contiguous())


def reference(student64: torch.Tensor, teacher, weights: torch.Tensor, **kd):
    """float64 loss and gradient w.r.t. the student logits of sum(weights * loss)."""
    z = student64.clone().requires_grad_()
    if isinstance(teacher, DenseTeacher):
        teacher = DenseTeacher(teacher.logits.double())
    loss = reference_kd_loss(z, teacher, **kd)
    (loss * weights).sum().backward()
    return loss.detach(), z.grad


def fused(student: torch.Tensor, teacher, weights: torch.Tensor, backend: str, tp_group=None, **kd):
    """Fused loss and gradient (a leaf copy of `student`, so nothing is written in place)."""
    z = student.clone().requires_grad_()
    loss = fused_kd_loss_or_none(z, teacher, backend=backend, tp_group=tp_group, **kd)
    assert loss is not None, f"backend {backend} declined {kd}"
    assert loss.dtype == torch.float32 and loss.shape == (student.shape[0],)
    (loss * weights.to(loss.dtype)).sum().backward()
    assert z.grad.dtype == student.dtype
    return loss.detach(), z.grad


def assert_matches(student64, teacher, backend: str, dtype=torch.float32, seed: int = 0, tol=None, **kd):
    """Fused vs brute force on the same (dtype-rounded) inputs, values and gradients."""
    student = student64.to(dtype)
    if isinstance(teacher, DenseTeacher):
        teacher = DenseTeacher(teacher.logits.to(dtype))
    # grad_output != 1 and different per row
    weights = torch.rand(student.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    ref_loss, ref_grad = reference(student.double(), teacher, weights, **kd)
    loss, grad = fused(student, teacher, weights, backend, **kd)
    loss_tol, grad_tol = tol or TOLERANCE[dtype]
    torch.testing.assert_close(loss.double(), ref_loss, atol=loss_tol, rtol=1e-4, msg=lambda m: f"loss {kd}: {m}")
    torch.testing.assert_close(grad.double(), ref_grad, atol=grad_tol, rtol=1e-2 if dtype != torch.float32 else 1e-4,
                               msg=lambda m: f"grad {kd}: {m}")
    return loss, grad


DENSE_CASES = [
    dict(divergence="forward_kl"),
    dict(divergence="reverse_kl", temperature=1.7),
    dict(divergence="jsd", beta=0.3, temperature=0.6),
    dict(divergence="jsd", beta=0.0),   # = unscaled forward KL
    dict(divergence="jsd", beta=1.0),   # = unscaled reverse KL
]

TOPK_CASES = [
    dict(divergence="forward_kl", mass="renorm"),
    dict(divergence="forward_kl", mass="tail", temperature=1.3),
    dict(divergence="forward_kl", mass="raw", coverage_coef=0.5),
    dict(divergence="forward_kl", mass="renorm", coverage_coef=1.0),
    dict(divergence="reverse_kl", mass="renorm", temperature=0.7),
    dict(divergence="reverse_kl", mass="tail", coverage_coef=0.3),
    dict(divergence="jsd", beta=0.4, mass="renorm"),
    dict(divergence="jsd", beta=0.7, mass="tail", temperature=2.0),
]

DENSE_SUPPORT_CASES = [
    dict(support="teacher", k=5, divergence="forward_kl", mass="tail"),
    dict(support="teacher", k=5, divergence="reverse_kl", mass="renorm", coverage_coef=0.2, temperature=1.5),
    dict(support="union", k=4, divergence="jsd", beta=0.5, mass="renorm"),
    dict(support="union", k=4, divergence="forward_kl", mass="raw"),
    dict(support="union", k=3, divergence="reverse_kl", mass="tail", temperature=0.8),
]
