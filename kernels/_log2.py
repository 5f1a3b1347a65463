"""Base-2 constants of the Triton kernels (exp(x) = exp2(x * LOG2E), log(x) = log2(x) * LN2; the
hardware's exp2 / log2 are the fast ones). A Triton kernel reads a global only when it is a
`tl.constexpr` object."""
from __future__ import annotations

import math

import triton.language as tl

LOG2E = tl.constexpr(1.0 / math.log(2.0))
LN2 = tl.constexpr(math.log(2.0))
