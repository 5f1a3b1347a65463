"""Deferred `triton.jit`: a kernel is decorated on first launch, once per interpreter mode.

Triton decides at decoration time whether a kernel is compiled or interpreted
(`TRITON_INTERPRET=1`). Decorating at import would freeze that choice for the whole process, so
a test that switches the interpreter on after something else imported this package would get
compiled kernels that cannot take CPU tensors. Decorating lazily, keyed by the mode, avoids that.
"""
from __future__ import annotations

import os
from typing import Callable


def interpreting() -> bool:
    """True when Triton runs kernels in its Python interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """Holds a kernel's Python function; `.get()` returns it decorated for the current mode."""

    def __init__(self, fn: Callable):
        self._fn = fn
        self._by_mode: dict[bool, object] = {}

    def get(self):
        mode = interpreting()
        if mode not in self._by_mode:
            import triton

            self._by_mode[mode] = triton.jit(self._fn)
        return self._by_mode[mode]


def lazy_jit(fn: Callable) -> LazyKernel:
    return LazyKernel(fn)
