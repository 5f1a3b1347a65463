"""Adapter from `kd_loss` to the fused kernels of `opkd_kernels` (Triton; the C++ twin on CPU).

`kd_loss(impl="auto" | "fused" | "triton" | "cpp")` calls `fused_kd_loss_or_none` after
validating its inputs. It returns the per-token loss (autograd-aware, the same contract and TP
all-reduces as the reference path) and the row statistics, or None when no kernel covers the case;
`kd_loss` then takes the reference path for "auto" and raises for the others.

Covered: student logits in float32 / bfloat16 / float16 (float64 means "exact maths", which is the
reference path's job); every divergence, support, mass and coverage option of `kd_loss`.
Where ("auto"): tensors on which `opkd_mcore.platform.triton_kernels_usable` says yes run the
Triton kernels; CPU tensors run the C++ twin when it was built (said once in the log when it was
not); anything else (Ascend NPU) the reference path. "triton" / "cpp" force one backend (tests,
benchmarks, and the Triton interpreter on CPU).

The gradient is written into the student-logits buffer when the logits are a model output (not a
leaf tensor), as Megatron's vocab-parallel cross entropy does; autograd then refuses any other
backward that saved the same logits, instead of silently reading overwritten values.
"""
from __future__ import annotations

import functools
import logging

import torch

from opkd_kernels import cpu_backend
from opkd_kernels.fused_kd import COVERED_DTYPES, fused_kd_loss, select_backend
from opkd_mcore.losses import validation
from opkd_mcore.losses.support_kd import select_support
from opkd_mcore.losses.teacher_outputs import DenseTeacher
from opkd_mcore.platform import device as platform_device

log = logging.getLogger(__name__)

_BACKENDS = ("auto", "triton", "cpp")


@functools.lru_cache(maxsize=None)
def _say_twin_missing() -> None:
    log.warning("kd_loss: the C++ CPU twin (opkd_kernels._cpu) is not built; the loss runs on the "
                "torch reference path (reinstall with a C++ compiler to get it)")


def _cpu_twin_built() -> bool:
    return cpu_backend.available()


def backend_for(student_logits: torch.Tensor, backend: str = "auto") -> str | None:
    """The fused backend that would run on `student_logits` ("triton" | "cpp"), or None; reads only
    its `device` and `dtype` (the loss plan asks with a stand-in before anything is allocated)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if student_logits.dtype not in COVERED_DTYPES:
        return None
    if backend != "auto":
        return backend
    if platform_device.triton_kernels_usable(student_logits):
        return "triton"
    if student_logits.device.type == "cpu":
        if _cpu_twin_built():
            return "cpp"
        _say_twin_missing()
    return None


def fused_kd_loss_or_none(student_logits: torch.Tensor, teacher, *, divergence: str = "forward_kl",
                          beta: float = 0.5, temperature: float = 1.0, support: str | None = None,
                          k: int | None = None, mass: str = "renorm", coverage_coef: float = 0.0,
                          tp_group=None, backend: str = "auto", inplace_grad: bool | None = None,
                          return_masses: bool = False):
    """Per-token loss `[N]` float32 from the fused kernels, or None if they do not cover the case.

    Same keywords as `kd_loss` (inputs already validated by it), plus `backend` ("auto" | "triton"
    | "cpp") and `inplace_grad` (None = in place unless the logits are a leaf tensor). With
    `return_masses`: `(loss, teacher_mass [N], student_mass [N], support_ids [N, K] | None)`.
    """
    name = backend_for(student_logits, backend)
    if name is None:
        return None

    impl = select_backend(student_logits, name)
    if impl is None:
        log.debug("fused KD: backend %s unavailable for %s tensors", name, student_logits.device.type)
        return None
    spec = validation.objective_spec(divergence=divergence, beta=beta, temperature=temperature,
                                     support=support, k=k, mass=mass, coverage_coef=coverage_coef)
    dense = teacher.logits.detach() if isinstance(teacher, DenseTeacher) else None
    ids = logprobs = None
    if support is not None:
        # The same support selection as the reference path (ties, top-k of a wider teacher).
        ids, logprobs, _ = select_support(student_logits, teacher, support=support, k=k, group=tp_group)
    loss, teacher_mass, student_mass = fused_kd_loss(
        student_logits, dense, ids, logprobs, spec=spec, tp_group=tp_group, backend=impl,
        inplace_grad=inplace_grad, return_masses=True)
    return (loss, teacher_mass, student_mass, ids) if return_masses else loss
