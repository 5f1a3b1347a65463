"""Device, collective backend and Megatron setup: the only place that names cuda/npu/nccl/hccl."""
from opkd_mcore.platform.device import (
    collective_backend,
    current_device,
    detect_device_type,
    device_type,
    is_accelerator_tensor,
    is_cpu,
    to_device_queued,
    triton_kernels_usable,
)
from opkd_mcore.platform.megatron_cpu import disable_cpu_emulation, enable_cpu_emulation
from opkd_mcore.platform.parallel import (
    ParallelConfig,
    destroy_parallel,
    global_rank,
    init_parallel,
    is_rank0,
)

__all__ = [
    "ParallelConfig",
    "destroy_parallel",
    "disable_cpu_emulation",
    "enable_cpu_emulation",
    "global_rank",
    "is_rank0",
    "init_parallel",
    "collective_backend",
    "current_device",
    "detect_device_type",
    "device_type",
    "is_accelerator_tensor",
    "is_cpu",
    "to_device_queued",
    "triton_kernels_usable",
]
