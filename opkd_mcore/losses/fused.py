"""Adapter from `kd_loss` to the fused kernels of `opkd_kernels` (Triton; the C++ twin on CPU).

`kd_loss(impl="auto" | "fused")` calls `fused_kd_loss_or_none` after validating its inputs. It
returns the per-token loss (autograd-aware, the same contract and TP all-reduces as the reference
path) or None when no kernel covers the case, and `kd_loss` then takes the reference path.

Covered: student logits in float32 / bfloat16 / float16 (float64 means "exact maths", which is the
reference path's job); every divergence, support, mass and coverage option of `kd_loss`.
Where: tensors on which `opkd_mcore.platform.triton_kernels_usable` says yes (Triton), and on CPU
the C++ twin when it was built and `OPKD_CPU_TWIN=1` (off by default: the issue keeps CPU runs on
the reference path; the twin is for CPU-only deployments and for its benchmark).

The gradient is written into the student-logits buffer when the logits are a model output (not a
leaf tensor), as Megatron's vocab-parallel cross entropy does; autograd then refuses any other
backward that saved the same logits, instead of silently reading overwritten values.
"""
from __future__ import annotations

import logging
import os

import torch

from opkd_mcore.losses.teacher_outputs import DenseTeacher
from opkd_mcore.platform import device as platform_device

log = logging.getLogger(__name__)

_CPU_TWIN_ENV = "OPKD_CPU_TWIN"
_COVERED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BACKENDS = ("auto", "triton", "cpp")


def _backend_name(student_logits: torch.Tensor, backend: str) -> str | None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if platform_device.triton_kernels_usable(student_logits):
        return "triton"
    if student_logits.device.type == "cpu" and os.environ.get(_CPU_TWIN_ENV) == "1":
        return "cpp"
    return None


def fused_kd_loss_or_none(student_logits: torch.Tensor, teacher, *, divergence: str = "forward_kl",
                          beta: float = 0.5, temperature: float = 1.0, support: str | None = None,
                          k: int | None = None, mass: str = "renorm", coverage_coef: float = 0.0,
                          tp_group=None, backend: str = "auto",
                          inplace_grad: bool | None = None) -> torch.Tensor | None:
    """Per-token loss `[N]` float32 from the fused kernels, or None if they do not cover the case.

    Same keywords as `kd_loss` (inputs already validated by it), plus `backend` ("auto" | "triton"
    | "cpp": force one, for tests and benchmarks) and `inplace_grad` (None = in place unless the
    logits are a leaf tensor).
    """
    if student_logits.dtype not in _COVERED_DTYPES:
        return None
    name = _backend_name(student_logits, backend)
    if name is None:
        return None
    from opkd_kernels.fused_kd import KdSpec, fused_kd_loss, select_backend

    impl = select_backend(student_logits, name)
    if impl is None:
        log.debug("fused KD: backend %s unavailable for %s tensors", name, student_logits.device.type)
        return None
    spec = KdSpec(divergence=divergence, beta=float(beta), temperature=float(temperature),
                  support=support, k=k, mass=mass, coverage_coef=float(coverage_coef))
    dense = teacher.logits.detach() if isinstance(teacher, DenseTeacher) else None
    ids = logprobs = None
    if support is not None:
        from opkd_mcore.losses.kd_loss import select_support

        # The same support selection as the reference path (ties, top-k of a wider teacher).
        ids, logprobs, _ = select_support(student_logits, teacher, support=support, k=k, group=tp_group)
    return fused_kd_loss(student_logits, dense, ids, logprobs, spec=spec, tp_group=tp_group,
                         backend=impl, inplace_grad=inplace_grad)
