"""Core attention for Megatron's local layer spec, on `F.scaled_dot_product_attention`.

Megatron's own local `DotProductAttention` allocates its score buffer from a CUDA memory pool and
rejects packed sequences; Transformer Engine is not available on CPU. This module is a drop-in
`core_attention` (same constructor and forward signature) that

* works on any device torch's SDPA runs on (CPU included),
* handles GQA by repeating each KV head for the query heads of its group (Megatron's grouping:
  query head h belongs to group h // (heads / groups)),
* is causal, and supports packed sequences (`PackedSeqParams`, qkv_format "thd"): each sequence
  between consecutive `cu_seqlens` attends only to itself (block-diagonal causal), computed as one
  right-padded batch when the lengths are similar and sequence by sequence otherwise.

Shapes: sbhd input q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads*d];
thd input q [t, heads, d], k/v [t, groups, d] -> [t, heads*d].
"""
from __future__ import annotations

import itertools
import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

# Packed sequences go through SDPA as one padded batch when padding costs at most this factor in
# tokens (B * longest <= budget * T); one call per sequence otherwise (a long sequence among short ones)
PADDED_BATCH_BUDGET = 2.0


class PackedLayout:
    """The host copy of one `cu_seqlens` tensor and its padded-batch gather indices per device.

    Every layer of a forward receives the same `PackedSeqParams`, so reading the boundaries once per
    tensor (not once per layer) leaves one device -> host read per micro-batch: each read makes the
    host wait for the device's queue to drain before it can launch the next layer."""

    def __init__(self, cu_seqlens: torch.Tensor):
        self._tensor = weakref.ref(cu_seqlens)
        self._version = _version_of(cu_seqlens)
        self.bounds: list[int] = cu_seqlens.tolist()
        self._indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def describes(self, cu_seqlens: torch.Tensor) -> bool:
        """Same tensor object, not modified in place since it was read."""
        return self._tensor() is cu_seqlens and _version_of(cu_seqlens) == self._version

    def padded_batch_indices(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, position in it) `[T]` of every packed token, on `device`."""
        if device not in self._indices:
            lens = torch.tensor([b - a for a, b in itertools.pairwise(self.bounds)])
            seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
            starts = torch.repeat_interleave(torch.tensor(self.bounds[:-1]), lens)
            pos = torch.arange(self.bounds[-1]) - starts
            self._indices[device] = (seq.to(device, non_blocking=True), pos.to(device, non_blocking=True))
        return self._indices[device]


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:   # inference-mode tensors keep no version counter
        return None


_RECENT_LAYOUTS: list[PackedLayout] = []
_RECENT_LAYOUTS_KEPT = 4   # q and kv boundaries of the current micro-batch, and the previous ones


def packed_layout(cu_seqlens: torch.Tensor) -> PackedLayout:
    """The `PackedLayout` of this tensor, read from the device only the first time it is seen."""
    for layout in _RECENT_LAYOUTS:
        if layout.describes(cu_seqlens):
            return layout
    layout = PackedLayout(cu_seqlens)
    _RECENT_LAYOUTS.insert(0, layout)
    del _RECENT_LAYOUTS[_RECENT_LAYOUTS_KEPT:]
    return layout


class SdpaCoreAttention(nn.Module):
    """Causal (optionally packed) multi-head attention with GQA via torch SDPA."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("SdpaCoreAttention: context_parallel_size must be 1 "
                             f"(got {config.context_parallel_size}); CP needs Transformer Engine")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or getattr(config, "softmax_scale", None) \
            or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SdpaCoreAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = getattr(mask_type, "name", str(mask_type)) != "no_mask"
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, causal)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._sdpa(q, k, v, causal)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _sdpa(self, q, k, v, causal: bool):
        """q [b, heads, sq, d], k/v [b, groups, sk, d] -> [b, heads, sq, d]."""
        heads, groups = q.shape[1], k.shape[1]
        if heads % groups:
            raise ValueError(f"SdpaCoreAttention: {heads} query heads not divisible by {groups} kv heads")
        if heads != groups:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        # causal with sq < sk (decoding against a cache) would need a bottom-right mask: not a use here
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal,
                                              scale=self.softmax_scale)

    def _packed(self, query, key, value, params, causal: bool):
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None \
            else params.cu_seqlens_kv
        layout = packed_layout(cu_q)
        bounds_q, bounds_kv = layout.bounds, (layout if cu_kv is cu_q else packed_layout(cu_kv)).bounds
        if bounds_q != bounds_kv:
            raise ValueError("SdpaCoreAttention: packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if bounds_q[-1] > query.shape[0]:
            raise ValueError(f"SdpaCoreAttention: cu_seqlens ends at {bounds_q[-1]} but the packed "
                             f"input has {query.shape[0]} tokens")
        lengths = [end - start for start, end in zip(bounds_q[:-1], bounds_q[1:])]
        if causal and len(lengths) > 1 and max(lengths) * len(lengths) <= PADDED_BATCH_BUDGET * bounds_q[-1]:
            return self._as_padded_batch(query, key, value, layout, lengths)
        out = query.new_zeros(query.shape[0], query.shape[1], query.shape[2])
        for start, end in zip(bounds_q[:-1], bounds_q[1:]):
            if end <= start:
                continue
            # [t, n, d] -> [1, n, t, d]
            q, k, v = (x[start:end].permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
            out[start:end] = self._sdpa(q, k, v, causal)[0].permute(1, 0, 2)
        return out.reshape(query.shape[0], -1)

    def _as_padded_batch(self, query, key, value, layout: PackedLayout, lengths: list[int]):
        """Causal attention of the packed sequences as one right-padded batch [B, n, S_max, d]:
        one SDPA call instead of one per sequence. Right padding needs no mask under causal
        attention: a real query at position t only sees keys 0..t, which are all real; the padded
        queries' outputs are dropped."""
        total, longest = layout.bounds[-1], max(lengths)
        seq, pos = layout.padded_batch_indices(query.device)

        def batched(x):  # [T, n, d] -> [B, n, S_max, d]
            padded = x.new_zeros(len(lengths), longest, x.shape[1], x.shape[2])
            padded[seq, pos] = x[:total]
            return padded.permute(0, 2, 1, 3)

        out_bnsd = self._sdpa(batched(query), batched(key), batched(value), True)
        out = query.new_zeros(query.shape[0], query.shape[1], query.shape[2])
        out[:total] = out_bnsd.permute(0, 2, 1, 3)[seq, pos]
        return out.reshape(query.shape[0], -1)
