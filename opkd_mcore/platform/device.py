"""Which accelerator this process runs on, and which collective backend goes with it.

This is the only place in `opkd_mcore` that names devices and backends. Everything else asks
for `device_type()` / `collective_backend()` and treats the answer as an opaque string.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

DEVICE_TYPES = ("cuda", "npu", "cpu")
BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_ENV_OVERRIDE = "OPKD_DEVICE"


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return hasattr(torch, "npu") and torch.npu.is_available()


@functools.lru_cache(maxsize=None)
def detect_device_type() -> str:
    """Auto-detect the accelerator: cuda, then npu, then cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def device_type(override: str | None = None) -> str:
    """The device type to use: explicit override, else $OPKD_DEVICE, else auto-detected."""
    choice = override or os.environ.get(_ENV_OVERRIDE) or detect_device_type()
    if choice not in DEVICE_TYPES:
        raise ValueError(f"device: expected one of {DEVICE_TYPES}, got {choice!r}")
    return choice


def collective_backend(device: str | None = None) -> str:
    """torch.distributed backend for a device type (nccl | hccl | gloo)."""
    return BACKEND_FOR_DEVICE[device_type(device)]


def is_cpu(device: str | None = None) -> bool:
    return device_type(device) == "cpu"


def current_device(device: str | None = None) -> torch.device:
    """The torch.device of this process (the local rank's accelerator, or cpu)."""
    kind = device_type(device)
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device())


def to_device_queued(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, the copy queued behind the device's work like a kernel: a host tensor bound for
    an accelerator goes through page-locked memory, since a blocking copy, or one from pageable memory
    beyond the driver's staging buffer, makes the host wait for the device's queue to drain."""
    if device.type != "cpu" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def is_accelerator_tensor(t: torch.Tensor, kind: str = "cuda") -> bool:
    """True when a tensor lives on the given accelerator type (used for kernel dispatch)."""
    return t.device.type == kind


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_kernels_usable(t: torch.Tensor) -> bool:
    """True when the Triton kernels in `opkd_kernels` can run on this tensor (a CUDA tensor + triton)."""
    return t.device.type == "cuda" and _triton_importable()
