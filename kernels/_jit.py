"""Deferred `triton.jit`: a kernel is decorated on first launch, once per interpreter mode.

Triton decides at decoration time whether a kernel is compiled or interpreted
(`TRITON_INTERPRET=1`). Decorating at import would freeze that choice for the whole process, so
a test that switches the interpreter on after something else imported this package would get
compiled kernels that cannot take CPU tensors. Decorating lazily, keyed by the mode, avoids that.

A jit helper that kernels call (`lazy_jit` too) is decorated with the kernel that calls it: the
kernel is decorated as a copy of its function whose globals name the helper decorated for the
same mode (a compiled kernel can only call a `JITFunction`, an interpreted one an
`InterpretedFunction`).
"""
from __future__ import annotations

import os
import types
from typing import Callable


def interpreting() -> bool:
    """True when Triton runs kernels in its Python interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """Holds a kernel's (or a jit helper's) Python function; `.get()` returns it decorated for the
    current mode."""

    def __init__(self, fn: Callable):
        self._fn = fn
        self._by_mode: dict[bool, object] = {}

    def get(self):
        mode = interpreting()
        if mode not in self._by_mode:
            import triton

            self._by_mode[mode] = triton.jit(_with_helpers(self._fn))
        return self._by_mode[mode]


def _with_helpers(fn: Callable) -> Callable:
    """`fn`, or a copy of it whose globals hold the helpers it calls (the `LazyKernel`s among the
    global names its code reads) decorated for the current mode."""
    helpers = {name: fn.__globals__[name].get() for name in fn.__code__.co_names
               if isinstance(fn.__globals__.get(name), LazyKernel)}
    if not helpers:
        return fn
    bound = types.FunctionType(fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__,
                               fn.__closure__)
    bound.__qualname__, bound.__doc__ = fn.__qualname__, fn.__doc__
    bound.__annotations__, bound.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
    return bound


def lazy_jit(fn: Callable) -> LazyKernel:
    return LazyKernel(fn)
