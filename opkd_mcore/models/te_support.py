"""Whether Transformer Engine builds this process's models: the one check behind the layer spec
(`builder.layer_spec`), the kernel fusions, the experts module (`grouped_experts`) and the config's
preflight."""
from __future__ import annotations

import importlib.util

from opkd_mcore.platform import is_cpu


def transformer_engine_usable(device: str | None = None) -> bool:
    """Whether models built on `device` (default: this process's) get the Transformer Engine spec:
    TE importable, and not on the CPU (its kernels are GPU-only)."""
    return not is_cpu(device) and importlib.util.find_spec("transformer_engine") is not None
