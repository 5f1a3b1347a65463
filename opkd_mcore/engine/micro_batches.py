"""Which sequences of a step each data-parallel rank trains, and in which micro-batches.

Two ways, chosen by `parallel.max_tokens_per_micro_batch`:

- by count (None): DP rank r takes the r-th contiguous slice of the step's sequences, cut into
  micro-batches of `micro_batch_size` sequences;
- by tokens (a budget): the sequences are dealt to the DP ranks so that every rank gets the same
  number of sequences and nearly the same number of tokens (longest first, to the rank with the
  fewest tokens), then each rank's sequences are dealt the same way into K micro-batches of at most
  the budget (a longer sequence gets one of its own). K is the same on every DP rank (the smallest
  that fits every rank), so collectives that run per micro-batch across DP ranks (MoE expert
  dispatch) stay matched.

Every rank computes every rank's split from the same sequence lengths: no collective is needed. The
loss is normalised by the step's global token and sequence counts, so the split changes only the
order of floating-point sums, not the gradient.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def balanced_partition(lengths: Sequence[int], parts: int, capacity: int | None = None) -> list[list[int]]:
    """Indices of `lengths` dealt into `parts` groups of nearly equal token sums: longest first, each
    to the group with the fewest tokens that has fewer than `capacity` members (ties: the lower
    group). Groups list their indices in ascending order. Deterministic."""
    if parts <= 0:
        raise ValueError(f"parts: expected > 0, got {parts}")
    if capacity is not None and capacity * parts < len(lengths):
        raise ValueError(f"capacity: {parts} groups of {capacity} cannot hold {len(lengths)} sequences")
    groups: list[list[int]] = [[] for _ in range(parts)]
    open_groups = [(0, g) for g in range(parts)]  # (tokens, group), a heap
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, g = heapq.heappop(open_groups)
        groups[g].append(i)
        if capacity is None or len(groups[g]) < capacity:
            heapq.heappush(open_groups, (tokens + lengths[i], g))
    return [sorted(group) for group in groups]


def data_parallel_split(lengths: Sequence[int], dp_size: int, *, balance_tokens: bool) -> list[list[int]]:
    """The sequence indices of each DP rank, the same count on every rank."""
    if len(lengths) % dp_size:
        raise ValueError(f"samples: {len(lengths)} per step do not split over {dp_size} DP ranks")
    per_rank = len(lengths) // dp_size
    if not balance_tokens:
        return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp_size)]
    return balanced_partition(lengths, dp_size, capacity=per_rank)


def consecutive_chunks(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` in order, cut into runs of at most `max_tokens` tokens (a longer
    sequence alone): the order is kept, so the first chunk can start before the last is known."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: expected a positive token budget, got {max_tokens}")
    chunks: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if not chunks or tokens + n > max_tokens:
            chunks.append([])
            tokens = 0
        chunks[-1].append(i)
        tokens += n
    return chunks


def _fits(groups: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    return all(sum(lengths[i] for i in g) <= max_tokens or len(g) == 1 for g in groups)


def token_budget_micro_batches(lengths: Sequence[int], ranks: list[list[int]],
                               max_tokens: int) -> list[list[list[int]]]:
    """Per DP rank, its sequences in K micro-batches of at most `max_tokens` tokens each (a longer
    sequence alone), K the same on every rank."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: expected a positive token budget, got {max_tokens}")
    per_rank = min(len(r) for r in ranks)
    k = max(math.ceil(sum(lengths[i] for i in r) / max_tokens) for r in ranks)
    k = min(max(k, 1), per_rank)
    while True:
        split = [[[r[j] for j in g] for g in balanced_partition([lengths[i] for i in r], k)] for r in ranks]
        if k == per_rank or all(_fits(groups, lengths, max_tokens) for groups in split):
            return split
        k += 1


def micro_batch_groups(lengths: Sequence[int], dp_size: int, dp_rank: int, *, micro_batch_size: int,
                       max_tokens: int | None) -> list[list[int]]:
    """This DP rank's micro-batches, as lists of indices into the step's sequences."""
    ranks = data_parallel_split(lengths, dp_size, balance_tokens=max_tokens is not None)
    if max_tokens is not None:
        return token_budget_micro_batches(lengths, ranks, max_tokens)[dp_rank]
    mine = ranks[dp_rank]
    return [mine[s:s + micro_batch_size] for s in range(0, len(mine), micro_batch_size)]
