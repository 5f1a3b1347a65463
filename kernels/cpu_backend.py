"""Python shim over the optional C++ twin `opkd_kernels._cpu` (csrc/kd_cpu.cpp)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _module():
    try:
        from . import _cpu
    except ImportError:  # not built (OPKD_SKIP_CPP=1, no compiler): the reference path is used
        return None
    return _cpu


def available() -> bool:
    """True when the C++ extension was built and imports."""
    return _module() is not None


class CppKdBackend:
    """The four fused-KD primitives on CPU tensors, OpenMP-parallel over rows."""

    name = "cpp"

    def __init__(self):
        if _module() is None:
            raise RuntimeError("opkd_kernels._cpu is not built; reinstall with a C++ compiler")
        self._m = _module()

    def row_stats(self, student, teacher, inv_t, want="ab"):   # computes both sums whatever `want`
        return self._m.row_stats(student, teacher, float(inv_t))

    def jsd_sums(self, student, teacher, lse, inv_t, beta):
        return self._m.jsd_sums(student, teacher, lse, float(inv_t), float(beta))

    def write_grad(self, student, teacher, out, lse, coef, inv_t, beta, code):
        self._m.write_grad(student, teacher, out, lse, coef, float(inv_t), float(beta), int(code))
        return out

    def sparse_scatter(self, out, local_ids, s_support, d_support, lse, coef):
        self._m.sparse_scatter(out, local_ids.contiguous(), s_support.contiguous(),
                               d_support.contiguous(), lse, coef)
        return out
