"""Megatron-core's unfused RoPE for packed (THD) sequences, without host syncs or per-sequence loops.

Without Transformer Engine (every CPU, and GPUs where TE is not installed) megatron-core 0.16.1
applies RoPE to packed sequences in `rope_utils._apply_rotary_pos_emb_thd`: `.tolist()` of the
sequence lengths, a `.item()` per sequence, and `torch.split` + one slice + `torch.cat` over the
sequences, for the query and again for the key of every layer. On a GPU each of those syncs makes
the host wait for the device, so it cannot queue the next layer's kernels: two stalls per layer
per micro-batch, plus ~4 small ops per sequence.

`apply_rotary_pos_emb_thd` computes the same thing with tensor ops on the device: each token's
position index into `freqs` (its offset in its own sequence, or its offset in the packed batch in
Megatron's "exact mapping" case, taken when `freqs` has one row per packed token), one gather, and
Megatron's own `_apply_rotary_pos_emb_bshd` on the whole packed tensor, so the result is the same
to the bit. Context parallelism (cp > 1) keeps Megatron's function: its two-chunk layout is not
reimplemented here. `install()` swaps the function in `rope_utils` (Megatron's files are not
edited); it runs before a model is built on the local (non-TE) layer spec.
"""
from __future__ import annotations

import inspect
import logging

import torch

logger = logging.getLogger(__name__)

_EXPECTED_PARAMETERS = ("t", "cu_seqlens", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale",
                        "cp_group")
_ORIGINAL = None


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                             rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                             mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """RoPE of packed `t [T, heads, d]`, sequences at `cu_seqlens [B+1]` (ending at T, as Megatron's
    `torch.split` requires), `freqs [S, 1, 1, d]`: Megatron's result without its host syncs."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    if cp_group.size() > 1:
        return _ORIGINAL(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                         multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    total = t.shape[0]
    token = torch.arange(total, device=t.device)
    if freqs.dim() >= 1 and freqs.shape[0] == total:
        position = token   # Megatron's exact mapping: sequence i reads freqs[cu[i]:cu[i+1]]
    else:
        starts = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - starts
        # output_size: the result's length is known, so no device -> host read of sum(lengths)
        position = token - torch.repeat_interleave(starts, lengths, output_size=total)
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[position], rotary_interleaved=rotary_interleaved,
                                      multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)


def install() -> bool:
    """Idempotent. Use `apply_rotary_pos_emb_thd` in Megatron's RoPE dispatch; False (and a warning)
    if this megatron-core's function has another signature, whose semantics it may not share."""
    global _ORIGINAL
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_thd
    if current is apply_rotary_pos_emb_thd:
        return True
    if tuple(inspect.signature(current).parameters) != _EXPECTED_PARAMETERS:
        logger.warning("megatron-core's _apply_rotary_pos_emb_thd has parameters %s, not %s: keeping it "
                       "(correct, but it syncs with the host twice per layer)",
                       tuple(inspect.signature(current).parameters), _EXPECTED_PARAMETERS)
        return False
    _ORIGINAL = current
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
    logger.info("megatron RoPE (THD, unfused): device-side positions instead of per-sequence host loops")
    return True
