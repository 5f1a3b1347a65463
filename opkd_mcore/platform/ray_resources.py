"""Ray's name for this platform's accelerator, so the controller never names a device itself.

Ray schedules GPUs as the built-in resource "GPU" and Ascend NPUs as "NPU" (it sets the matching
visible-devices variable in each actor); a CPU-only run reserves CPUs only.
"""
from __future__ import annotations

from opkd_mcore.platform.device import device_type

RAY_RESOURCE_FOR_DEVICE = {"cuda": "GPU", "npu": "NPU", "cpu": None}


def ray_accelerator_resource(device: str | None = None) -> str | None:
    """The Ray resource that reserves one accelerator of `device` (None on CPU)."""
    return RAY_RESOURCE_FOR_DEVICE[device_type(device)]


def ray_actor_resources(device: str | None, accelerators: float) -> dict:
    """Keyword options of `ray.remote(...)` that reserve `accelerators` of this platform's kind."""
    name = ray_accelerator_resource(device)
    if name is None or accelerators == 0:
        return {}
    if name == "GPU":
        return {"num_gpus": accelerators}
    return {"resources": {name: accelerators}}
