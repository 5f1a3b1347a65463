"""`opkd_kernels._jit`: a kernel and the jit helpers it calls are decorated together, per mode.

A compiled Triton kernel can only call a `JITFunction` and an interpreted one only an
`InterpretedFunction`; the helper is decorated lazily, as the kernel is, so the kernel must see the
helper decorated for the same mode whichever mode was first used in the process. No kernel runs
here (the interpreter tests in test_fused_linear_kd_triton.py run the helper itself).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from opkd_kernels import _logit_tile, linear_kd_grad, linear_kd_jsd_sums, linear_kd_row_stats  # noqa: E402
from opkd_kernels._jit import LazyKernel, lazy_jit  # noqa: E402

TILE_KERNELS = [linear_kd_row_stats._KERNEL, linear_kd_grad._KERNEL, linear_kd_jsd_sums._KERNEL]


def _python_fn(decorated):
    return decorated.fn


@pytest.mark.parametrize("interpret, kind", [("0", JITFunction), ("1", InterpretedFunction)])
def test_tile_kernels_see_the_logit_tile_helper_decorated_for_their_mode(monkeypatch, interpret, kind):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    helper = _logit_tile.logit_tile.get()
    assert isinstance(helper, kind)
    for lazy in TILE_KERNELS:
        kernel = lazy.get()
        assert isinstance(kernel, kind)
        assert _python_fn(kernel).__globals__["logit_tile"] is helper
    # the modules' own globals keep the lazy helper: the other mode can still be decorated
    assert isinstance(linear_kd_grad.logit_tile, LazyKernel)


def test_both_modes_in_one_process_keep_apart(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = linear_kd_grad._KERNEL.get()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = linear_kd_grad._KERNEL.get()
    assert isinstance(interpreted, InterpretedFunction) and isinstance(compiled, JITFunction)
    assert isinstance(_python_fn(interpreted).__globals__["logit_tile"], InterpretedFunction)
    assert isinstance(_python_fn(compiled).__globals__["logit_tile"], JITFunction)


def _no_helper(x_ptr):
    pass


def test_a_kernel_without_helpers_is_decorated_as_it_is(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _python_fn(lazy_jit(_no_helper).get()) is _no_helper
