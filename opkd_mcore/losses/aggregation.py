"""Reduce per-token losses of a packed micro-batch to the scalar that is back-propagated.

Micro-batches and DP ranks each call `aggregate` on their own tokens; passing the *global*
denominator (tokens or sequences of the whole optimizer step, over all micro-batches and DP
ranks) makes the sum of the micro-batch losses equal the loss of the global batch, so gradient
accumulation and data parallelism do not change the loss scale. Without it the denominator is
this micro-batch's own (fine for evaluation, wrong for accumulation over unequal micro-batches).

Modes:
- "token-mean": sum over valid tokens / number of valid tokens.
- "seq-mean-token-mean": sum over sequences of w_i * mean over the sequence's valid tokens, / the
  number of sequences (or the sum of the weights w_i, e.g. TCAD's per-prompt weights, which sum
  to 1 per prompt so that the denominator is the number of prompts).
- "seq-mean-token-sum": as above with the sum over the sequence's tokens instead of the mean.
A sequence without any valid token contributes nothing and is not counted.

No host syncs when `num_seqs` is given (otherwise one, to read max(seq_ids)): denominators
stay tensors.
"""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence index `[T]` of every token of a packed batch with boundaries `cu_seqlens [B+1]`."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None = None,
              mode: str = "token-mean", global_num_tokens=None, *, global_num_seqs=None,
              seq_weights: torch.Tensor | None = None, num_seqs: int | None = None) -> torch.Tensor:
    """Scalar loss from `per_token [T]`, `loss_mask [T]` (1 = counted) and `seq_ids [T]` (int).

    global_num_tokens: denominator of "token-mean" (number or tensor); default: local count.
    global_num_seqs: denominator of the seq modes; default: local count of sequences with a valid
        token (or the local sum of their `seq_weights`).
    seq_weights: `[B]` per-sequence weights for the seq modes (treated as constants).
    num_seqs: B, when `seq_ids` may not mention the last sequences (default max(seq_ids) + 1).
    """
    _check_mode(mode, per_token, loss_mask)
    mask = loss_mask.to(per_token.dtype)
    masked = torch.where(loss_mask.bool(), per_token, torch.zeros_like(per_token))
    if mode == "token-mean":
        denom = mask.sum() if global_num_tokens is None else global_num_tokens
        return masked.sum() / _positive(denom, per_token)
    ids, count, weights = _seq_terms(mask, seq_ids, mode, seq_weights, num_seqs)
    seq_sum = per_token.new_zeros(count.shape[0]).index_add_(0, ids, masked)
    seq_value = seq_sum / count.clamp(min=1) if mode == "seq-mean-token-mean" else seq_sum
    denom = weights.sum() if global_num_seqs is None else global_num_seqs
    return (weights * seq_value).sum() / _positive(denom, per_token)


def aggregate_row_weights(loss_mask: torch.Tensor, seq_ids: torch.Tensor | None = None,
                          mode: str = "token-mean", global_num_tokens=None, *, global_num_seqs=None,
                          seq_weights: torch.Tensor | None = None,
                          num_seqs: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`c [T]` with `aggregate(per_token, loss_mask, ...) == sum(c * per_token)` for every `per_token`
    (`aggregate` is linear in it; same arguments): d loss / d per_token, known before the loss is.
    The fused LM head's "rows" engine takes it to compute the gradients in its forward. 0 on rows
    that are not counted."""
    _check_mode(mode, loss_mask, loss_mask)
    mask = loss_mask.to(dtype)
    if mode == "token-mean":
        denom = mask.sum() if global_num_tokens is None else global_num_tokens
        return mask / _positive(denom, mask)
    ids, count, weights = _seq_terms(mask, seq_ids, mode, seq_weights, num_seqs)
    per_seq = weights / count.clamp(min=1) if mode == "seq-mean-token-mean" else weights
    denom = weights.sum() if global_num_seqs is None else global_num_seqs
    return mask * per_seq[ids] / _positive(denom, mask)


def _check_mode(mode: str, per_token: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"mode: expected one of {AGG_MODES}, got {mode!r}")
    if per_token.dim() != 1 or loss_mask.shape != per_token.shape:
        raise ValueError(f"loss_mask: expected shape {tuple(per_token.shape)} (that of per_token [T]), "
                         f"got {tuple(loss_mask.shape)}")


def _seq_terms(mask: torch.Tensor, seq_ids, mode: str, seq_weights, num_seqs):
    """(seq_ids as int64 [T], valid tokens per sequence [B], sequence weights [B]: 0 for a sequence
    without a valid token, else seq_weights or 1), all in mask's dtype where floating."""
    if seq_ids is None or seq_ids.shape != mask.shape:
        raise ValueError(f"seq_ids: mode {mode!r} needs a sequence index per token, shape "
                         f"{tuple(mask.shape)}, got {None if seq_ids is None else tuple(seq_ids.shape)}")
    num = num_seqs if num_seqs is not None else (int(seq_ids.max()) + 1 if seq_ids.numel() else 0)
    ids = seq_ids.long()
    count = mask.new_zeros(num).index_add_(0, ids, mask)
    weights = (count > 0).to(mask.dtype)
    if seq_weights is not None:
        if seq_weights.shape != (num,):
            raise ValueError(f"seq_weights: expected shape ({num},) (one weight per sequence), "
                             f"got {tuple(seq_weights.shape)}")
        weights = weights * seq_weights.detach().to(mask.dtype)
    return ids, count, weights


def _positive(denom, like: torch.Tensor):
    """A denominator that is never 0 (an empty batch gives loss 0, not NaN)."""
    if isinstance(denom, torch.Tensor):
        return denom.to(like.dtype).clamp(min=torch.finfo(like.dtype).tiny)
    return max(float(denom), torch.finfo(like.dtype).tiny)
