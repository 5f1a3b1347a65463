"""Collectives and index helpers over a vocabulary sharded across a tensor-parallel group.

Rank r of the group holds the contiguous ids `[r * V_local, (r + 1) * V_local)`, as Megatron's
output layer produces. Every collective takes the group explicitly and returns early when the
group is `None` or has one member, so the TP=1 path touches no process group at all.

Shape legend: N tokens, V_local vocab entries on this rank, C support ids per token.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group_size(group) == 1:
        return 0
    return dist.get_rank(group)


def all_reduce_max_(x: torch.Tensor, group) -> torch.Tensor:
    """In place. Forward: element-wise max over the group. (Used in forward passes only.)"""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_reduce_sum_(x: torch.Tensor, group) -> torch.Tensor:
    """In place. Forward: element-wise sum over the group. (Used in forward passes only.)"""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def shard_offset(v_local: int, group) -> int:
    """First global vocabulary id held by this rank."""
    return group_rank(group) * v_local


def local_index(ids_NC: torch.Tensor, v_local: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global ids to this shard: `(index_NC, on_shard_NC)`.

    Off-shard ids and padding (-1) get index 0 with `on_shard=False`. Index 0 is also a real id
    on this shard, so callers must never write through `index` without the mask: use
    `scatter_add_` with masked (zero) sources, or read with `gather` and mask the result.
    """
    local = ids_NC - offset
    on_shard = (ids_NC >= 0) & (local >= 0) & (local < v_local)
    return torch.where(on_shard, local, torch.zeros_like(local)), on_shard


def gather_local(x_NV: torch.Tensor, index_NC: torch.Tensor, on_shard_NC: torch.Tensor) -> torch.Tensor:
    """This rank's contribution to `x[:, ids]`: the value where the id is on this shard, else 0.

    Summing the contributions over the group (one SUM all-reduce) gives `x[:, ids]` everywhere.
    """
    picked = torch.gather(x_NV, 1, index_NC)
    return torch.where(on_shard_NC, picked, torch.zeros_like(picked))


def support_mask_local(index_NC: torch.Tensor, on_shard_NC: torch.Tensor, v_local: int) -> torch.Tensor:
    """Bool `[N, V_local]`: True where a local vocab entry is one of the row's support ids.

    Built with `scatter_add_` of the on-shard mask so off-shard ids (mapped to index 0) add 0 and
    cannot collide with a real id 0.
    """
    counts = torch.zeros(index_NC.shape[0], v_local, dtype=torch.int32, device=index_NC.device)
    counts.scatter_add_(1, index_NC, on_shard_NC.to(torch.int32))
    return counts > 0


def local_max(x_NV: torch.Tensor, exclude_NV: torch.Tensor | None = None) -> torch.Tensor:
    """Row max over the entries not excluded; -inf where every entry is excluded."""
    if exclude_NV is not None:
        x_NV = x_NV.masked_fill(exclude_NV, float("-inf"))
    return x_NV.amax(dim=1)


def local_sumexp(x_NV: torch.Tensor, max_N: torch.Tensor,
                 exclude_NV: torch.Tensor | None = None) -> torch.Tensor:
    """Row `sum(exp(x - max))` over the entries not excluded, with `max` the group-wide max."""
    e = torch.exp(x_NV - finite_or_zero(max_N)[:, None])
    if exclude_NV is not None:
        e = e.masked_fill(exclude_NV, 0.0)
    return e.sum(dim=1)


def logsumexp_from(max_N: torch.Tensor, sumexp_N: torch.Tensor) -> torch.Tensor:
    """Combine a group-wide max and sum of exponentials into log-sum-exp (-inf for empty sets)."""
    return finite_or_zero(max_N) + torch.log(sumexp_N)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Replace -inf maxima (empty sets) by 0 so that `exp(x - max)` stays 0 instead of NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def sharded_topk(x_NV: torch.Tensor, k: int, group) -> torch.Tensor:
    """Global ids `[N, k]` of the k largest entries per row of a vocab-sharded `x`.

    Local top-k, one all-gather of the k * TP candidates, then a global top-k over them; never
    gathers the full vocabulary. Values and ids travel together as float64 (exact for every
    float input and for ids below 2**53). Entries with exactly equal values at the k-th place may
    be chosen differently for different TP sizes, as with any top-k.
    """
    v_local = x_NV.shape[1]
    world = group_size(group)
    local_vals, local_idx = x_NV.topk(min(k, v_local), dim=1)
    local_ids = local_idx + shard_offset(v_local, group)
    if world == 1:
        return local_ids
    packed = torch.cat([local_vals.to(torch.float64), local_ids.to(torch.float64)], dim=1).contiguous()
    parts = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed, group=group)
    width = local_vals.shape[1]
    cand_vals = torch.cat([part[:, :width] for part in parts], dim=1)
    cand_ids = torch.cat([part[:, width:] for part in parts], dim=1)
    best = cand_vals.topk(k, dim=1).indices
    return torch.gather(cand_ids, 1, best).to(torch.int64)
