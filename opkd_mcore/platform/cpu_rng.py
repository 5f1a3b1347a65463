"""Megatron's model-parallel RNG tracker, backed by the CPU generator (part of the CPU emulation).

Megatron keeps named CUDA generator states ("model-parallel-rng" differs per TP rank, so dropout
and weight init in TP regions differ across shards; "data-parallel-rng" is shared) and forks into
them with `get_cuda_rng_tracker().fork()`. On CPU the generator every torch op draws from is the
default CPU generator, so the tracker saves/restores that one.
"""
from __future__ import annotations

import contextlib


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False):
    import torch

    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe: bool = False):
    import torch

    torch.set_rng_state(new_state)


def make_cpu_tracker():
    """A `CudaRNGStatesTracker` subclass whose states are CPU generator states."""
    import torch
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Named RNG states on the CPU generator; same API and semantics as Megatron's tracker."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed: {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"name: rng state {name!r} is already tracked")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise KeyError(f"rng state {name!r} was not added to the tracker")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker()


def install_cpu_rng(saved: dict):
    """Make Megatron's tracker a CPU tracker; record what was replaced in `saved` for restore."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = make_cpu_tracker()
    for name, value in (("_CUDA_RNG_STATE_TRACKER", tracker),
                        ("_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
                        ("_get_cuda_rng_state", _cpu_get_rng_state),
                        ("_set_cuda_rng_state", _cpu_set_rng_state)):
        saved[("megatron.random", name)] = (mrandom, getattr(mrandom, name))
        setattr(mrandom, name, value)
    return tracker


def seed_cpu_model_parallel(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """CPU twin of Megatron's `model_parallel_cuda_manual_seed` (same seed offsets)."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
