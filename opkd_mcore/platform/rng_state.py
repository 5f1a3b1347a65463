"""Capture / restore every RNG a training rank draws from (for exact resume from a checkpoint).

Python, numpy, the torch CPU generator, the accelerator's default generator (cuda / npu; none on
CPU), and Megatron's model-parallel tracker (whose named states are accelerator generator states
on accelerators, CPU generator states under the CPU emulation).

The captured dict holds only tensors, numbers, strings and containers, so that a checkpoint's RNG
file loads with `torch.load(..., weights_only=True)`: numpy's key array travels as a tensor.
"""
from __future__ import annotations

import logging
import random
from types import ModuleType

import torch

from opkd_mcore.platform import megatron_cpu
from opkd_mcore.platform.device import device_type

logger = logging.getLogger(__name__)


def _accelerator() -> tuple[str, ModuleType] | None:
    """(device type, torch's module for it) when this process draws from an accelerator generator."""
    # under the CPU emulation `torch.cuda` is patched and every draw uses the CPU generator (saved)
    if megatron_cpu.is_enabled():
        return None
    kind = device_type()
    return None if kind == "cpu" else (kind, getattr(torch, kind))


def _numpy_state() -> dict | None:
    try:
        import numpy as np
    except ImportError:
        return None
    key, keys, pos, has_gauss, cached = np.random.get_state()
    return {"key": key, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_state(state: dict) -> None:
    import numpy as np

    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["key"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))


def capture_rng_states() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    accel = _accelerator()
    if accel is not None:
        kind, module = accel
        state["accelerator"] = {"device": kind, "state": module.get_rng_state()}
    return state


def restore_rng_states(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    if "accelerator" in state:
        _restore_accelerator(state["accelerator"])


def _restore_accelerator(saved: dict) -> None:
    accel = _accelerator()
    if accel is None or accel[0] != saved["device"]:
        # e.g. a GPU checkpoint resumed on CPU: that generator does not exist here
        logger.warning("RNG state of device %r not restored: this process runs on %s", saved["device"],
                       accel[0] if accel else "cpu")
        return
    accel[1].set_rng_state(saved["state"])
