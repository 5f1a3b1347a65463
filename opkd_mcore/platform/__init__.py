"""Device, collective backend and Megatron setup: the only place that names cuda/npu/nccl/hccl."""
from opkd_mcore.platform.device import (
    collective_backend,
    current_device,
    detect_device_type,
    device_type,
    is_accelerator_tensor,
    is_cpu,
    triton_kernels_usable,
)

__all__ = [
    "collective_backend",
    "current_device",
    "detect_device_type",
    "device_type",
    "is_accelerator_tensor",
    "is_cpu",
    "triton_kernels_usable",
]
