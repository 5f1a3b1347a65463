"""Sequences packed end to end without padding, the layout the student trains on.

A `PackedBatch` holds B sequences concatenated into T tokens. Attention never crosses a sequence
boundary because Megatron receives `PackedSeqParams(qkv_format="thd")` built from `cu_seqlens`,
and RoPE restarts at every boundary for the same reason.

Row t of every per-token tensor belongs to position t: `loss_mask[t] == 1` when the logits at t
predict a response token (token t+1 of the same sequence). Teacher rows follow the same rule
("row t scores token t+1"), so `teacher` and `sampler_logprobs` slice exactly like `tokens`.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher, SpanIndex
from opkd_mcore.losses.teacher_outputs import DenseTeacher, HiddenTeacher, TopKTeacher
from opkd_mcore.platform import to_device_queued


@dataclass
class CpLayout:
    """A context-parallel rank's view of the whole packing (`engine/context_parallel.py`): what attention
    and RoPE read of it, and where this rank's rows come from."""

    # [B'+1] int32 real lengths (B' >= B: an extra padding sequence), to map rows back
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor  # [B'+1] int32, each sequence padded to a multiple of 2*cp
    max_seqlen: int  # the longest padded sequence (RoPE's table and the attention kernel read it)
    cp: int
    rank: int
    num_sequences: int  # B, the batch's own sequences
    total_multiple: int  # every rank's token count is a multiple of it (TP with sequence parallelism)
    source: torch.Tensor  # [T_local] int64 row of the unsharded batch, -1 for padding
    positions: torch.Tensor  # [T_local] int64 position in the (padded) full sequence
    local_lengths: list[int]  # tokens of each padded sequence on every rank


@dataclass
class PackedBatch:
    """B sequences packed into T tokens (no padding between them)."""

    tokens: torch.Tensor  # [T] int64 token ids
    position_ids: torch.Tensor  # [T] int64, restarts at 0 for every sequence
    cu_seqlens: torch.Tensor  # [B+1] int32 cumulative sequence lengths, cu_seqlens[0] = 0
    loss_mask: torch.Tensor  # [T] float32, 1 where position t predicts a response token t+1
    teacher: DenseTeacher | TopKTeacher | CrossTokenizerTeacher | None = None  # row t scores t+1
    sampler_logprobs: torch.Tensor | None = None  # [T] logprob of token t+1 under the rollout sampler
    sequence_weights: torch.Tensor | None = None  # [B] per-sequence weights (e.g. teacher confidence)
    # [T] task-reward advantage of the sequence, on its response rows
    task_advantages: torch.Tensor | None = None
    # an in-step teacher on tokens of its own (teacher prompts, another tokenizer): its packing of the
    # samples' teacher-side sequences, in the same order (engine/teacher_in_step.py), and, with teacher
    # prompts, per row here the row of that packing paired with it (`engine/response_pairing.py`, -1:
    # none; across tokenizers the span index of `teacher` pairs them instead)
    teacher_tokens: PackedBatch | None = None
    teacher_index: torch.Tensor | None = None  # [T] int64
    # a context-parallel rank's share of a batch (`engine/context_parallel.py`): token t+1 of each row
    # (it may sit on another rank) and the whole packing as attention reads it
    next_tokens: torch.Tensor | None = None  # [T] int64
    context: CpLayout | None = None
    meta: dict = field(default_factory=dict)  # free-form bookkeeping (never read by the engine)
    # longest sequence, read once at construction: Megatron wants a host int per micro-batch, and
    # reading it from device tensors there would stall the pipeline
    max_seqlen: int = field(init=False, repr=False, default=0)

    def __post_init__(self):
        self.validate()
        self.max_seqlen = int(self.seq_lengths.max())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def seq_lengths(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def seq_ids(self) -> torch.Tensor:
        """[T] int64: index of the sequence each token belongs to."""
        # output_size: the host knows T; without it the device would be asked for the sum (a sync)
        return torch.repeat_interleave(torch.arange(self.num_sequences, device=self.tokens.device),
                                       self.seq_lengths.to(self.tokens.device), output_size=self.num_tokens)

    def validate(self) -> None:
        t = self.tokens
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"tokens: expected a 1-D int64 tensor [T], got {tuple(t.shape)} {t.dtype}")
        n = t.numel()
        for name in ("position_ids", "loss_mask", "sampler_logprobs", "task_advantages", "next_tokens"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (n,):
                raise ValueError(f"{name}: expected shape ({n},) like tokens, got {tuple(value.shape)}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32:
            raise ValueError(f"cu_seqlens: expected a 1-D int32 tensor [B+1] with B >= 1, "
                             f"got {tuple(cu.shape)} {cu.dtype}")
        if int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"cu_seqlens: expected strictly increasing from 0 to T={n}, got {cu.tolist()}")
        if self.teacher is not None:
            rows = _teacher_rows(self.teacher)
            if rows != n:
                raise ValueError(f"teacher: expected {n} rows (one per token), got {rows}")
        if self.teacher_index is not None:
            if self.teacher_tokens is None or tuple(self.teacher_index.shape) != (n,):
                raise ValueError(f"teacher_index: expected shape ({n},) with teacher_tokens set, got "
                                 f"{tuple(self.teacher_index.shape)} with teacher_tokens "
                                 f"{'set' if self.teacher_tokens is not None else 'None'}")
            if int(self.teacher_index.max()) >= self.teacher_tokens.num_tokens:
                raise ValueError(f"teacher_index: rows up to {int(self.teacher_index.max())}, but "
                                 f"teacher_tokens holds {self.teacher_tokens.num_tokens}")
        if self.sequence_weights is not None and tuple(self.sequence_weights.shape) != (self.num_sequences,):
            raise ValueError(f"sequence_weights: expected shape ({self.num_sequences},), "
                             f"got {tuple(self.sequence_weights.shape)}")

    def packed_seq_params(self):
        """Megatron's description of the packing (THD format, one entry per sequence)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        c = self.context
        if c is not None:
            # context parallel: the whole padded packing. The padding closes each sequence, so under the
            # causal mask no real token attends to it; declared as padding instead, its output rows are
            # not defined by TE (a row that is not finite, even outside the loss, turns the gradients NaN)
            # and the FlashAttention backend is ruled out
            cu = c.cu_seqlens_padded
            return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                   cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                   max_seqlen_q=c.max_seqlen, max_seqlen_kv=c.max_seqlen)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def to(self, device) -> "PackedBatch":
        """A copy with every tensor (teacher rows included) on `device`, each copy queued behind the
        device's work (`to_device_queued`): no host sync per tensor per micro-batch."""
        device = torch.device(device)

        def move(x):
            if isinstance(x, torch.Tensor):
                return to_device_queued(x, device)
            if isinstance(x, PackedBatch):
                return x.to(device)
            if isinstance(x, _ROW_HOLDERS):
                return dataclasses.replace(x, **{f.name: move(getattr(x, f.name))
                                                 for f in dataclasses.fields(x)})
            return x
        # a shallow copy, not dataclasses.replace: moving tensors keeps every invariant checked at
        # construction, and re-validating device tensors would cost host syncs per micro-batch
        moved = copy.copy(self)
        for f in dataclasses.fields(self):
            if f.name != "meta":
                setattr(moved, f.name, move(getattr(self, f.name)))
        return moved


_ROW_HOLDERS = (DenseTeacher, TopKTeacher, HiddenTeacher, CrossTokenizerTeacher, SpanIndex, CpLayout)


def _teacher_rows(teacher) -> int:
    if isinstance(teacher, CrossTokenizerTeacher):  # one row per student token, its own rows apart
        return teacher.num_rows
    first = (teacher.logits if isinstance(teacher, DenseTeacher)
             else teacher.hidden if isinstance(teacher, HiddenTeacher) else teacher.ids)
    return int(first.shape[0])


def pack_sequences(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], *,
                   sampler_logprobs: Sequence[Sequence[float]] | None = None,
                   teacher: DenseTeacher | TopKTeacher | None = None,
                   sequence_weights: torch.Tensor | None = None,
                   task_advantages: Sequence[float] | None = None) -> PackedBatch:
    """Pack prompt+response token lists into one `PackedBatch`.

    `prompt_lengths[i]` is the number of prompt tokens at the start of `sequences[i]`; the loss
    covers the positions that predict the remaining (response) tokens. `sampler_logprobs[i]`, if
    given, holds one logprob per response token of sequence i and is placed at the predicting
    positions. `teacher` must already have one row per packed token. `task_advantages[i]`, if
    given, is sequence i's task-reward advantage, placed on its response rows.
    """
    if len(sequences) == 0:
        raise ValueError("sequences: expected at least one sequence, got none")
    if len(prompt_lengths) != len(sequences):
        raise ValueError(f"prompt_lengths: expected {len(sequences)} entries (one per sequence), "
                         f"got {len(prompt_lengths)}")
    lengths = [len(s) for s in sequences]
    for i, (length, p) in enumerate(zip(lengths, prompt_lengths)):
        if not 1 <= p <= length:
            raise ValueError(f"prompt_lengths[{i}]: expected 1 <= prompt length <= sequence length "
                             f"{length}, got {p}")
    total = sum(lengths)
    tokens = torch.tensor([tok for s in sequences for tok in s], dtype=torch.int64)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    loss_mask = torch.zeros(total, dtype=torch.float32)
    logprobs = None if sampler_logprobs is None else torch.zeros(total, dtype=torch.float32)
    advantages = None if task_advantages is None else torch.zeros(total, dtype=torch.float32)
    if task_advantages is not None and len(task_advantages) != len(sequences):
        raise ValueError(f"task_advantages: expected {len(sequences)} values (one per sequence), "
                         f"got {len(task_advantages)}")
    for i, (start, n, p) in enumerate(zip(cu[:-1].tolist(), lengths, prompt_lengths)):
        # position t predicts token t+1: positions p-1 .. n-2 predict the response tokens p .. n-1
        loss_mask[start + p - 1:start + n - 1] = 1.0
        if advantages is not None:
            advantages[start + p - 1:start + n - 1] = float(task_advantages[i])
        if logprobs is not None:
            row = sampler_logprobs[i]
            if len(row) != n - p:
                raise ValueError(f"sampler_logprobs[{i}]: expected {n - p} values (one per response "
                                 f"token), got {len(row)}")
            logprobs[start + p - 1:start + n - 1] = torch.tensor(row, dtype=torch.float32)
    return PackedBatch(tokens=tokens, position_ids=position_ids, cu_seqlens=cu, loss_mask=loss_mask,
                       teacher=teacher, sampler_logprobs=logprobs, sequence_weights=sequence_weights,
                       task_advantages=advantages)


def pack_model_input(sequences: Sequence[Sequence[int]]) -> PackedBatch:
    """Token sequences packed as a model reads them (tokens, positions, cu_seqlens), with no loss rows:
    an in-step teacher's own packing (`PackedBatch.teacher_tokens`), whose rows a pairing selects."""
    return pack_sequences(sequences, [len(s) for s in sequences])


def pad_for_pipeline(batch: PackedBatch, length: int) -> PackedBatch:
    """Model input of `batch` padded to `length` tokens for a fixed-shape pipeline.

    The padding is one extra packed sequence (token 0, positions from 0, no loss), so attention
    never mixes it with real tokens; only the tensors the model reads are kept (an in-step teacher's
    own packing, padded to the same length: both travel through the pipeline in one tensor).
    """
    pad = length - batch.num_tokens
    if pad < 0:
        raise ValueError(f"length: expected >= the batch's {batch.num_tokens} tokens, got {length}")
    teacher = None if batch.teacher_tokens is None else pad_for_pipeline(batch.teacher_tokens, length)
    if pad == 0:
        return PackedBatch(tokens=batch.tokens, position_ids=batch.position_ids,
                           cu_seqlens=batch.cu_seqlens, loss_mask=batch.loss_mask, teacher_tokens=teacher)
    device = batch.tokens.device
    return PackedBatch(
        tokens=torch.cat([batch.tokens, torch.zeros(pad, dtype=torch.int64, device=device)]),
        position_ids=torch.cat([batch.position_ids, torch.arange(pad, dtype=torch.int64, device=device)]),
        cu_seqlens=torch.cat([batch.cu_seqlens, batch.cu_seqlens.new_full((1,), length)]),
        loss_mask=torch.cat([batch.loss_mask, torch.zeros(pad, dtype=batch.loss_mask.dtype, device=device)]),
        teacher_tokens=teacher,
    )


def split_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens` tokens, in order.

    A sequence longer than the budget gets a micro-batch of its own (it is never cut).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: expected a positive token budget, got {max_tokens}")
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and used + n <= max_tokens:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups
