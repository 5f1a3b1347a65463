"""Megatron-core's MoE layers without Transformer Engine (every CPU, and GPUs without TE).

megatron-core 0.16.1 imports `te_general_gemm` inside a `try: import transformer_engine` block
(`transformer/moe/moe_utils.py`) and later tests `te_general_gemm is not None` unguarded in the
router's gating GEMM, so without TE the very first router forward raises `NameError`. The fallback
right behind that test (`torch.mm` in the router dtype) is what we want; defining the missing name
as None selects it. Megatron's files are not edited; this runs before an MoE model is built.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def prepare_megatron_moe() -> None:
    """Idempotent: make Megatron's MoE router usable when Transformer Engine is not importable."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        logger.info("megatron MoE: Transformer Engine absent, router GEMM falls back to torch.mm")
