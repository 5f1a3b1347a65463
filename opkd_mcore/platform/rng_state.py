"""Capture / restore every RNG a training rank draws from (for exact resume from a checkpoint).

Python, numpy, the torch CPU generator, and Megatron's model-parallel tracker (whose named states
are CUDA/NPU generator states on accelerators, CPU generator states under the CPU emulation).
"""
from __future__ import annotations

import random

import torch


def capture_rng_states() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng_states(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
