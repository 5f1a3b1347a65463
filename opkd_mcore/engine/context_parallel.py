"""Context parallelism of a packed (THD) micro-batch: which tokens each CP rank holds.

Megatron and Transformer Engine split a packed batch the same way, and the attention (TE's
`DotProductAttention` with a CP group) relies on it: every sequence is padded to a multiple of
`2*cp`, cut into `2*cp` equal chunks, and CP rank r holds chunks r and `2*cp-1-r` (under the causal
mask the early chunks attend to little and the late ones to much, so each rank gets as much work).
The rank's tokens are those two chunks of sequence 0, then of sequence 1, and so on (TE's
`thd_get_partitioned_indices`; `partition_indices` computes the same indices with torch ops).

`shard_batch` gives each rank its `PackedBatch`: every per-token tensor (tokens, loss mask, sampler
logprobs, advantages, teacher rows) sliced with the same indices, padding rows with no loss and no
teacher (top-k ids -1), the next token of every row taken before the cut (a row's next token may sit
on another rank), and a `CpLayout` that hands attention the whole padded packing: `cu_seqlens` and
`cu_seqlens_padded` both padded, as verl does (each sequence's padding comes after its tokens, so the
causal mask keeps it out of every real token's attention), read by TE's attention and by Megatron's
RoPE (positions are those of the full sequence), and the longest padded sequence. The loss is per
token, so each rank's loss over its rows, normalised by the step's global token count, adds up over
the CP group (Megatron's DDP sums gradients over DP x CP) to the loss and gradients of CP=1.
`gather_cp_rows` puts per-rank rows back in the batch's order (a forward-only caller's logits).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from opkd_mcore.engine.packing import CpLayout, PackedBatch
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher
from opkd_mcore.losses.teacher_outputs import DenseTeacher, HiddenTeacher, TopKTeacher


def padded_lengths(lengths: list[int], cp: int, total_multiple: int = 1) -> list[int]:
    """Each length rounded up to a multiple of `2*cp`; with `total_multiple` > 1 (sequence parallelism:
    each rank's tokens split evenly over TP) one more padding sequence makes the total a multiple of
    `2*cp*total_multiple`, so every rank holds a multiple of `total_multiple` tokens."""
    if cp < 1:
        raise ValueError(f"cp: expected >= 1, got {cp}")
    unit = 2 * cp
    padded = [-(-n // unit) * unit for n in lengths]
    block = unit * total_multiple
    extra = -(-sum(padded) // block) * block - sum(padded)
    return padded + [extra] if extra else padded


def partition_indices(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """`[T_padded / cp]` int64 positions of the padded packing that CP rank `rank` holds: per sequence,
    chunk `rank` then chunk `2*cp-1-rank` of its `2*cp` equal chunks (TE's partitioned indices)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank: expected 0 <= rank < cp={cp}, got {rank}")
    cu = cu_seqlens_padded.long().cpu()
    lengths = cu[1:] - cu[:-1]
    if bool((lengths % (2 * cp)).any()):
        raise ValueError(f"cu_seqlens_padded: every sequence must be a multiple of 2*cp={2 * cp} tokens, "
                         f"got lengths {lengths.tolist()}")
    chunk = lengths // (2 * cp)
    local = 2 * chunk  # tokens of each sequence on this rank
    total = int(local.sum())
    local_starts = torch.cumsum(local, 0) - local
    offset = torch.arange(total) - torch.repeat_interleave(local_starts, local, output_size=total)
    start, size = (torch.repeat_interleave(x, local, output_size=total) for x in (cu[:-1], chunk))
    first = offset < size  # the first half is chunk `rank`, the second chunk `2*cp-1-rank`
    late = start + (2 * cp - 1 - rank) * size + offset - size
    return torch.where(first, start + rank * size + offset, late)


def cp_layout(cu_seqlens: torch.Tensor, cp: int, rank: int, total_multiple: int = 1) -> CpLayout:
    """The CP layout of a packing with real boundaries `cu_seqlens` (int32 `[B+1]`, on the host)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    padded = padded_lengths(lengths, cp, total_multiple)
    real = lengths + padded[len(lengths):]  # the extra padding sequence is all "real" to attention
    cu_real = torch.tensor([0, *real], dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0, *padded], dtype=torch.int64).cumsum(0).to(torch.int32)
    # source row of every padded position: the batch's row, -1 for padding
    offsets = torch.arange(int(cu_padded[-1])) - torch.repeat_interleave(
        cu_padded[:-1].long(), torch.tensor(padded), output_size=int(cu_padded[-1]))
    seq = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))
    n = len(lengths)
    within = (seq < n) & (offsets < torch.tensor(real)[seq])
    source = torch.where(within, cu_seqlens.long()[seq.clamp(max=n - 1)] + offsets, -1)
    index = partition_indices(cu_padded, cp, rank)
    return CpLayout(cu_seqlens=cu_real, cu_seqlens_padded=cu_padded, max_seqlen=max(padded), cp=cp, rank=rank,
                    num_sequences=n, total_multiple=total_multiple, source=source[index],
                    positions=offsets[index], local_lengths=[p // cp for p in padded])


def shard_batch(batch: PackedBatch, cp: int, rank: int, total_multiple: int = 1) -> PackedBatch:
    """CP rank `rank`'s share of `batch` (see the module docstring); `batch` must be on the host."""
    if batch.teacher_tokens is not None or isinstance(batch.teacher, CrossTokenizerTeacher):
        raise ValueError("batch: a teacher on its own packing (teacher prompts, another tokenizer) cannot be "
                         "split over context-parallel ranks; use parallel.cp: 1")
    layout = cp_layout(batch.cu_seqlens, cp, rank, total_multiple)
    src = layout.source
    real = src >= 0
    rows = src.clamp(min=0)

    def take(x: torch.Tensor | None, fill=0):
        if x is None:
            return None
        out = x[rows]
        return out.masked_fill(~real.view(-1, *[1] * (out.dim() - 1)), fill)

    n = len(layout.local_lengths)
    lengths = layout.local_lengths[:batch.num_sequences]
    lengths[-1] += sum(layout.local_lengths[batch.num_sequences:n])  # the extra padding, in the last
    cu = torch.zeros(batch.num_sequences + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return PackedBatch(
        tokens=take(batch.tokens), position_ids=layout.positions.clone(), cu_seqlens=cu,
        loss_mask=take(batch.loss_mask), teacher=_take_teacher(batch.teacher, take),
        sampler_logprobs=take(batch.sampler_logprobs), sequence_weights=batch.sequence_weights,
        task_advantages=take(batch.task_advantages), meta=dict(batch.meta),
        next_tokens=take(torch.roll(batch.tokens, -1) if batch.next_tokens is None else batch.next_tokens),
        context=layout)


def _take_teacher(teacher, take):
    if teacher is None:
        return None
    if isinstance(teacher, TopKTeacher):
        return TopKTeacher(ids=take(teacher.ids, -1), logprobs=take(teacher.logprobs, float("-inf")))
    if isinstance(teacher, DenseTeacher):
        return DenseTeacher(take(teacher.logits))
    if isinstance(teacher, HiddenTeacher):
        return dataclasses.replace(teacher, hidden=take(teacher.hidden))
    raise ValueError(f"batch.teacher: cannot split a {type(teacher).__name__} over context-parallel ranks")


def gather_cp_rows(local: torch.Tensor, layout: CpLayout, group) -> torch.Tensor:
    """The whole batch's rows `[T, ...]` in its order, from every CP rank's `local` rows (collective
    over `group`, the CP group; forward only)."""
    parts = [torch.empty_like(local) for _ in range(layout.cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    batch_cu = layout.cu_seqlens[:layout.num_sequences + 1].cpu()
    out = local.new_empty((int(batch_cu[-1]), *local.shape[1:]))
    for r, part in enumerate(parts):
        source = cp_layout(batch_cu, layout.cp, r, layout.total_multiple).source.to(local.device)
        keep = source >= 0
        out[source[keep]] = part[keep]
    return out
