"""Weights between HF safetensors and Megatron GPTModel chunks: sliced load, streamed export, save.

* `load_hf_weights`: every rank reads only the slices of the HF tensors its parameters hold
  (`safe_open(...).get_slice`), so no rank materialises the whole model.
* `hf_weight_metadata`: the full model's HF tensors (name, shape, dtype, PP stage, and for a routed
  expert the EP rank holding it) in export order, computed from the config and layout alone:
  identical on every rank, no communication.
* `iter_hf_weights`: the stream `(hf_name, full_tensor)` in that order: TP (expert-TP) shards
  gathered, fused QKV / gate-up split back, vocab padding removed; "local" = this PP stage's tensors
  that this rank can produce (the shared ones and its own EP rank's experts), "all" = every tensor on
  every rank (experts broadcast over the EP group, then stages over the PP group).
* `save_hf_checkpoint`: rank 0 writes sharded safetensors + index + config + tokenizer files into a
  directory beside the target and swaps it in once complete.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from opkd_mcore.models.bridge import TensorRule
from opkd_mcore.models.builder import ModelLayout, layout_of, unwrap
from opkd_mcore.models.moe_bridge import local_expert_slot
from opkd_mcore.platform import current_device
from opkd_mcore.platform.durable import replace_dir, staging_dir

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class WeightMeta:
    """One HF tensor of the exported model."""

    hf_name: str
    shape: tuple
    dtype: torch.dtype
    pp_stage: int
    ep_rank: int | None = None  # routed experts: the EP rank that holds this tensor; None = every one

    @property
    def num_bytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _LocalParam:
    param: torch.Tensor  # the parameter, or one expert's slice of a stacked experts parameter
    rule: TensorRule
    layer: int | None
    expert: int | None = None  # global index of a routed expert

    @property
    def hf_names(self) -> list[str]:
        return [t.format(layer=self.layer, expert=self.expert) for t in self.rule.hf]


def _tp(expert: bool = False):
    """(rank, size, group) of the TP group that splits a tensor: expert TP for routed experts."""
    from megatron.core import parallel_state as ps

    if expert:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _local_params(model_chunks) -> list[_LocalParam]:
    """Every parameter of this rank's chunks with the rule that maps it to HF tensors."""
    layout = layout_of(model_chunks)
    layer_rules = {r.megatron: r for r in layout.bridge.layer_rules()}
    model_rules = {r.megatron: r for r in layout.bridge.model_rules()}
    first_expert = layout.ep_rank * layout.num_local_experts
    found = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            expert = None
            if name.startswith("decoder.layers."):
                local_idx, suffix = name[len("decoder.layers."):].split(".", 1)
                layer = model.decoder.layers[int(local_idx)].layer_number - 1
                slot = local_expert_slot(suffix)
                if slot is not None:  # local expert i of this EP rank is global expert first_expert + i
                    suffix, local = slot
                    if local is None:  # stacked experts: expert i is the view param[i]
                        found += [_LocalParam(param.detach()[i], layer_rules[suffix], layer, first_expert + i)
                                  for i in range(param.shape[0])]
                        continue
                    expert = first_expert + local
                rule = layer_rules.get(suffix)
            else:
                layer, rule = None, model_rules.get(name)
            if rule is None:
                raise ValueError(f"{layout.bridge.family} bridge has no HF mapping for Megatron "
                                 f"parameter {name!r}")
            found.append(_LocalParam(param, rule, layer, expert))
    return found


# --------------------------------------------------------------------------- load
class _SafetensorsIndex:
    """HF tensor name -> file, over a single or sharded safetensors checkpoint."""

    def __init__(self, hf_dir: str):
        index_path, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"hf_dir: neither {INDEX_FILE} nor {SINGLE_FILE} in {hf_dir!r}")
        self.hf_dir = hf_dir
        self._open: dict = {}

    def slice(self, name: str):
        if name not in self.files:
            raise KeyError(f"HF checkpoint {self.hf_dir!r} has no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_slice(name)


def _read_owned(index: _SafetensorsIndex, lp: _LocalParam, layout: ModelLayout) -> torch.Tensor:
    """The part of the HF tensor(s) that this TP rank's shard of `lp.param` holds."""
    rank, size, _ = _tp(lp.rule.is_expert)
    names, kind = lp.hf_names, lp.rule.kind.removeprefix("expert_")
    if kind == "replicated":
        return index.slice(names[0])[:]
    if kind == "row":
        sl = index.slice(names[0])
        cols = sl.get_shape()[1] // size
        return sl[:, rank * cols:(rank + 1) * cols]
    if kind == "vocab":
        rows = layout.padded_vocab_size // size
        start, stop = rank * rows, min((rank + 1) * rows, layout.vocab_size)
        sl = index.slice(names[0])
        out = torch.zeros(rows, *sl.get_shape()[1:], dtype=lp.param.dtype)
        if stop > start:
            out[:stop - start] = sl[start:stop]
        return out
    if kind == "gate_up":
        parts = []
        for name in names:
            sl = index.slice(name)
            rows = sl.get_shape()[0] // size
            parts.append(sl[rank * rows:(rank + 1) * rows])
        return torch.cat(parts)
    if kind == "qkv":
        return _read_qkv(index, names, layout, rank, size)
    raise ValueError(f"unknown tensor rule kind {lp.rule.kind!r}")


def _read_qkv(index, names, layout: ModelLayout, rank: int, size: int) -> torch.Tensor:
    """Fuse this rank's query groups: per group [its q heads; its k head; its v head]."""
    bridge = layout.bridge
    d, groups = bridge.head_dim, bridge.num_query_groups
    q_per_group = bridge.hf_config.num_attention_heads // groups
    g0, g1 = rank * groups // size, (rank + 1) * groups // size
    q = index.slice(names[0])[g0 * q_per_group * d:g1 * q_per_group * d]
    k = index.slice(names[1])[g0 * d:g1 * d]
    v = index.slice(names[2])[g0 * d:g1 * d]
    tail = q.shape[1:]
    q = q.reshape(g1 - g0, q_per_group * d, *tail)
    k, v = k.reshape(g1 - g0, d, *tail), v.reshape(g1 - g0, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


@torch.no_grad()
def load_hf_weights(model_chunks, hf_dir: str) -> None:
    """Fill this rank's parameters from an HF checkpoint, reading only the slices they own (an EP
    rank reads only its own experts' tensors, and of those only its expert-TP slice)."""
    layout = layout_of(model_chunks)
    index = _SafetensorsIndex(hf_dir)
    for lp in _local_params(model_chunks):
        owned = _read_owned(index, lp, layout)
        if tuple(owned.shape) != tuple(lp.param.shape):
            raise ValueError(f"HF tensor(s) {lp.hf_names} give a shard of shape {tuple(owned.shape)}"
                             f" but the Megatron parameter has shape {tuple(lp.param.shape)}")
        lp.param.data.copy_(owned.to(dtype=lp.param.dtype))


# --------------------------------------------------------------------------- metadata
def hf_weight_metadata(model_chunks) -> list[WeightMeta]:
    """The full model's HF tensors in export order; same on every rank, no communication."""
    layout = layout_of(model_chunks)
    bridge, cfg = layout.bridge, layout.bridge.hf_config
    dtype = unwrap(model_chunks[0]).config.params_dtype
    last = layout.pp - 1
    meta = [WeightMeta("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), dtype, 0)]
    expert_of = getattr(bridge, "expert_of", lambda name: None)
    for layer in range(cfg.num_hidden_layers):
        stage = layout.layer_stage(layer)
        for name, shape in bridge.hf_layer_shapes(layer):
            expert = expert_of(name)
            owner = None if expert is None else layout.expert_owner(expert)
            meta.append(WeightMeta(name, shape, dtype, stage, owner))
    meta.append(WeightMeta("model.norm.weight", (cfg.hidden_size,), dtype, last))
    if not bridge.tied:
        meta.append(WeightMeta("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), dtype, last))
    return meta


# --------------------------------------------------------------------------- export
def _gather_flat(shard: torch.Tensor, expert: bool) -> torch.Tensor:
    """`[size, *shard.shape]`: every (expert) TP rank's shard in one all-gather into one tensor."""
    _, size, group = _tp(expert)
    if size == 1:
        return shard.unsqueeze(0)
    # the concatenated form: gloo takes no other (torch >= 2.13 renames the call)
    out = torch.empty((size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, shard.contiguous(), group=group)
    return out.view(size, *shard.shape)


def _views_to_hf(lp: _LocalParam, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """The full HF tensors of one Megatron parameter (collective over TP, or expert TP), without
    copies: views of the parameter (TP size 1) or of one all-gather of its shards, each in a shape
    that refines the HF shape (a dimension split in two: the same elements in the same row-major
    order), so a consumer copies each straight into place. Row-parallel: [rows, tp, cols / tp];
    gate/up: [tp, rows / tp, cols]; q/k/v: [groups, rows, *tail]."""
    kind, names, w = lp.rule.kind.removeprefix("expert_"), lp.hf_names, lp.param.detach()
    if kind == "replicated":
        return {names[0]: w}
    gathered = _gather_flat(w, lp.rule.is_expert)
    size, tail = gathered.shape[0], w.shape[1:]
    if kind == "row":
        return {names[0]: w if size == 1 else gathered.movedim(0, 1)}
    if kind == "vocab":
        return {names[0]: gathered.view(-1, *tail)[:layout.vocab_size]}
    if kind == "gate_up":
        halves = gathered.view(size, 2, w.shape[0] // 2, *tail)
        if size == 1:
            return {names[0]: halves[0, 0], names[1]: halves[0, 1]}
        return {names[0]: halves[:, 0], names[1]: halves[:, 1]}
    if kind == "qkv":
        d, groups = layout.bridge.head_dim, layout.bridge.num_query_groups
        q_per_group = layout.bridge.hf_config.num_attention_heads // groups
        q, k, v = gathered.view(groups, (q_per_group + 2) * d, *tail).split([q_per_group * d, d, d], dim=1)
        return {names[0]: q, names[1]: k, names[2]: v}
    raise ValueError(f"unknown tensor rule kind {kind!r}")


def _shard_in_hf(lp: _LocalParam, layout: ModelLayout, name: str,
                 hf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the part of HF tensor `name`, given as `hf` in its HF shape, that this TP rank's shard of
    `lp.param` holds; that part of the shard), or None where another rank writes it (a replicated
    tensor: TP rank 0 does). The inverse of `_read_owned`, for an export in which every TP rank
    writes its own shard into place (the weight sync's peer export)."""
    rank, size, _ = _tp(lp.rule.is_expert)
    kind, w = lp.rule.kind.removeprefix("expert_"), lp.param.detach()
    part, tail = lp.hf_names.index(name), w.shape[1:]
    if kind == "replicated":
        return (hf, w) if rank == 0 else None
    if kind == "row":
        return hf.view(hf.shape[0], size, -1)[:, rank], w
    if kind == "vocab":
        start = rank * w.shape[0]
        stop = min(start + w.shape[0], layout.vocab_size)  # the padding rows go nowhere
        return (hf[start:stop], w[:stop - start]) if stop > start else None
    if kind == "gate_up":
        rows = w.shape[0] // 2
        return hf.view(size, rows, *tail)[rank], w[part * rows:(part + 1) * rows]
    if kind == "qkv":
        d, groups = layout.bridge.head_dim, layout.bridge.num_query_groups
        q_rows = layout.bridge.hf_config.num_attention_heads // groups * d
        local, rows = groups // size, (q_rows, d, d)[part]
        mine = w.view(local, q_rows + 2 * d, *tail).split([q_rows, d, d], dim=1)[part]
        return hf.view(groups, rows, *tail)[rank * local:(rank + 1) * local], mine
    raise ValueError(f"unknown tensor rule kind {kind!r}")


def shard_writes(model_chunks,
                 named_hf: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs that fill this TP rank's part of each HF tensor in `named_hf`
    (name, a tensor in the HF shape, e.g. a view into a weight-sync bucket) from its own shards:
    every TP rank copying its pairs fills the tensors whole, without a collective."""
    layout, producers = layout_of(model_chunks), _producers(model_chunks)
    out = []
    for name, hf in named_hf:
        if name not in producers:
            raise RuntimeError(f"no local parameter produces {name!r} on PP stage {layout.pp_rank}")
        pair = _shard_in_hf(producers[name], layout, name, hf)
        if pair is not None:
            out.append(pair)
    return out


def _producers(model_chunks) -> dict[str, _LocalParam]:
    out: dict[str, _LocalParam] = {}
    for lp in _local_params(model_chunks):
        for name in lp.hf_names:
            out.setdefault(name, lp)  # a tied output layer never shadows the embedding
    return out


def is_local(meta: WeightMeta, layout: ModelLayout) -> bool:
    """True when this rank holds (its shard of) the tensor: its PP stage, and its EP rank's expert."""
    return meta.pp_stage == layout.pp_rank and meta.ep_rank in (None, layout.ep_rank)


def _iter_local(model_chunks, metadata, views: bool = False) -> Iterator[tuple[WeightMeta, torch.Tensor]]:
    layout = layout_of(model_chunks)
    producers = _producers(model_chunks)
    pending: dict[str, torch.Tensor] = {}
    for meta in metadata:
        if not is_local(meta, layout):
            continue
        if meta.hf_name not in pending:
            if meta.hf_name not in producers:
                raise RuntimeError(f"no local parameter produces {meta.hf_name!r} on PP stage "
                                   f"{layout.pp_rank}")
            pending.update(_views_to_hf(producers[meta.hf_name], layout))
        tensor = pending.pop(meta.hf_name)
        if not views:  # a tensor of its own in the HF shape: one copy (the view's shape refines it)
            out = torch.empty(meta.shape, dtype=tensor.dtype, device=tensor.device)
            out.view(tensor.shape).copy_(tensor)
            tensor = out
        yield meta, tensor


@torch.no_grad()
def iter_hf_weights(model_chunks, *, stages: str = "local",
                    select: Callable[[WeightMeta], bool] | None = None,
                    views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(hf_name, full_tensor)` in `hf_weight_metadata` order.

    Collective: all TP ranks of a stage (and expert-TP ranks of an EP rank) iterate together; for
    "all", every rank. `select` ("local" only) keeps the tensors it returns True for: the same
    predicate on every rank of a TP / expert-TP group (weight sync splits the stream by sender).
    `views` ("local" only): each tensor comes as a view of its parameter (TP size 1) or of one
    all-gather of its shards, in a shape that refines the HF shape (see `_views_to_hf`), valid until
    the next optimizer step: for a consumer that copies each one into place right away, as the
    weight-sync sender does. Either way a TP group runs the same collectives.
    """
    if stages not in ("local", "all"):
        raise ValueError(f"stages: expected 'local' or 'all', got {stages!r}")
    if (select is not None or views) and stages != "local":
        raise ValueError("select, views: only with stages='local'")
    metadata = hf_weight_metadata(model_chunks)
    if select is not None:
        metadata = [m for m in metadata if select(m)]
    layout = layout_of(model_chunks)
    if stages == "local" or (layout.pp == 1 and layout.ep == 1):
        for meta, tensor in _iter_local(model_chunks, metadata, views):
            yield meta.hf_name, tensor
        return
    yield from _iter_all(model_chunks, metadata, layout)


def _iter_all(model_chunks, metadata, layout: ModelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor on every rank: an expert goes from its EP rank to the stage's other EP ranks
    (EP group), then each tensor from its stage to the other stages (PP group, whose ranks share
    one EP rank)."""
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if layout.ep > 1 else None
    local = _iter_local(model_chunks, metadata)
    for meta in metadata:
        if is_local(meta, layout):
            _, tensor = next(local)
            tensor = tensor.contiguous()
        else:
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=current_device())
        if meta.ep_rank is not None and ep_group is not None and meta.pp_stage == layout.pp_rank:
            dist.broadcast(tensor, src=dist.get_global_rank(ep_group, meta.ep_rank), group=ep_group)
        if layout.pp > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(pp_group, meta.pp_stage), group=pp_group)
        yield meta.hf_name, tensor


# --------------------------------------------------------------------------- save
def plan_shards(metadata: list[WeightMeta], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of the tensors (in order) into files of at most `max_shard_bytes` each."""
    shards, current, size = [], [], 0
    for meta in metadata:
        if current and size + meta.num_bytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(meta.hf_name)
        size += meta.num_bytes
    if current:
        shards.append(current)
    return shards


def _copy_side_files(src_hf_dir: str, out_dir: str) -> None:
    """Config, tokenizer and generation files of the source checkpoint (not its weights)."""
    for name in os.listdir(src_hf_dir):
        path = os.path.join(src_hf_dir, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES) and name != INDEX_FILE:
            shutil.copy2(path, os.path.join(out_dir, name))


def save_hf_checkpoint(model_chunks, out_dir: str, *, src_hf_dir: str | None = None,
                       max_shard_bytes: int = 4 << 30, progress: bool = True) -> None:
    """Write the model as an HF checkpoint: collective over all ranks, rank 0 writes the files.

    The files go to a directory beside `out_dir` (`.<name>.tmp-<pid>`) that replaces it once every
    file is written and fsynced (`platform.durable.replace_dir`): a crash mid-export leaves the
    previous export whole, never an index naming a mix of old and new shards. Only the writer rank
    touches the filesystem; the others stream their tensors to it and wait at the closing barrier.
    """
    from safetensors.torch import save_file

    metadata = hf_weight_metadata(model_chunks)
    shards = plan_shards(metadata, max_shard_bytes)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    file_of = {}
    for i, names in enumerate(shards):
        for name in names:
            file_of[name] = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    staging = _start_staging(out_dir) if writer else None
    try:
        stream = iter_hf_weights(model_chunks, stages="all")
        if writer and progress:
            from tqdm import tqdm

            stream = tqdm(stream, total=len(metadata), desc="save HF checkpoint", unit="tensor")
        buffer: dict[str, torch.Tensor] = {}
        shard_idx = 0
        for name, tensor in stream:
            if not writer:
                continue
            buffer[name] = tensor.detach().to("cpu").contiguous()
            if len(buffer) == len(shards[shard_idx]):
                save_file(buffer, os.path.join(staging, file_of[name]), metadata={"format": "pt"})
                buffer, shard_idx = {}, shard_idx + 1
        if writer:
            _write_index_and_config(model_chunks, staging, metadata, file_of, src_hf_dir)
            replace_dir(staging, out_dir)
    except BaseException:
        if staging is not None:  # our own partial files; the previous export is untouched
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()


def _start_staging(out_dir: str) -> str:
    """A new, empty staging directory beside `out_dir` (a leftover of this pid's is ours to clear)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir}: exists and is not a directory; an HF export replaces a directory")
    staging = staging_dir(out_dir)
    if os.path.lexists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def _write_index_and_config(model_chunks, out_dir, metadata, file_of, src_hf_dir) -> None:
    index = {"metadata": {"total_size": sum(m.num_bytes for m in metadata)},
             "weight_map": {m.hf_name: file_of[m.hf_name] for m in metadata}}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    if src_hf_dir is not None:
        _copy_side_files(src_hf_dir, out_dir)
    else:
        layout_of(model_chunks).bridge.hf_config.save_pretrained(out_dir)
