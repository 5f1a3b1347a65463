"""Routed experts as grouped GEMMs, and the one decision of which experts module an MoE model runs.

`model.moe_experts` picks the implementation of Megatron's experts submodule (`MoELayer.experts`):

* ``te_grouped``: Megatron's `TEGroupedMLP` (Transformer Engine's grouped linear; GPUs with TE),
* ``torch_grouped``: `TorchGroupedMLP` below (`torch._grouped_mm`: CPU float32/bfloat16, sm90 bf16),
* ``sequential``: Megatron's `SequentialMLP` (a Python loop of per-expert linears; runs everywhere),
* ``auto``: torch_grouped where it runs, else te_grouped where TE is installed, else sequential,
  probed once (`resolve_experts`) and logged with why.

`TorchGroupedMLP` holds the local experts' weights as two stacked parameters, ``fc1_weight``
[E_local, 2F/etp, H] (gate rows, then up rows, as `SequentialMLP`'s ``linear_fc1.weight``) and
``fc2_weight`` [E_local, H, F/etp]. Stacked rather than one parameter per expert (TE's
``weight{i}``): the forward hands the parameter to the grouped GEMM as it is, where per-expert
parameters would be copied into one stacked tensor every forward (and the gradient split back): at
the 30B-A3B shape with 64 local experts, ~0.6 GB of bf16 weights per layer and forward, against
~0.3 TFLOP of expert GEMMs (estimated, not measured). The weight export loses nothing by it:
expert i's matrix is the view ``fc1_weight[i]``, the same [rows, cols] matrix, in the same memory
order, as ``local_experts.{i}.linear_fc1.weight``, so loading, the HF export and the weight sync
map it with the same per-expert rules (`weights._local_params` expands a stacked parameter into
one view per expert). Its distributed checkpoint stores exactly `SequentialMLP`'s global tensors
(same keys, same per-expert shards), so a checkpoint moves between the two implementations.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from opkd_mcore.config.schema import MOE_EXPERTS
from opkd_mcore.models.te_support import transformer_engine_usable
from opkd_mcore.platform import current_device, is_cpu, to_device_queued

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the decision
@dataclass(frozen=True)
class ExpertsChoice:
    """Which experts module the MoE layers run, and why (logged once where it is resolved)."""

    impl: str  # te_grouped | torch_grouped | sequential
    reason: str

    @property
    def grouped_gemm(self) -> bool:
        """Megatron's `moe_grouped_gemm` flag: only the TE grouped module reads it."""
        return self.impl == "te_grouped"


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(dtype: torch.dtype, hidden: int, ffn_local: int, device: str) -> str | None:
    """None when `torch._grouped_mm` runs forward and backward for this dtype and the experts'
    shapes on `device`, else why not (the exception's message). One tiny call per shape."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        x = torch.zeros(2, hidden, dtype=dtype, device=device, requires_grad=True)
        w1 = torch.zeros(1, 2 * ffn_local, hidden, dtype=dtype, device=device, requires_grad=True)
        w2 = torch.zeros(1, hidden, ffn_local, dtype=dtype, device=device, requires_grad=True)
        offs = torch.tensor([2], dtype=torch.int32, device=device)
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)[:, :ffn_local].contiguous()
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        y.backward(torch.ones_like(y))
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return str(err).splitlines()[0]
    return None


def resolve_experts(requested: str, params_dtype: torch.dtype, hidden: int, ffn_local: int,
                    key: str = "model.moe_experts") -> ExpertsChoice:
    """The experts module for `requested` (one of `MOE_EXPERTS`) on this device. An explicit choice
    that cannot run here raises `ValueError` naming `key` and what is missing."""
    if requested not in MOE_EXPERTS:
        raise ValueError(f"{key}: expected one of {MOE_EXPERTS}, got {requested!r}")
    device = str(current_device())
    te = transformer_engine_usable()
    if requested == "te_grouped" and not te:
        raise ValueError(f"{key}: te_grouped needs Transformer Engine on a GPU "
                         f"({'CPU run' if is_cpu() else 'transformer_engine is not installed'})")
    if requested in ("te_grouped", "sequential"):
        return ExpertsChoice(requested, "asked for")
    # auto prefers torch's grouped GEMM where it runs: on an H200 (Qwen3-30B-A3B experts, 4096 tokens)
    # it trained 2.3x faster than TE's grouped linear (docs/benchmarks.md, "MoE student")
    why_not = grouped_mm_runs(params_dtype, hidden, ffn_local, device)
    if why_not is None:
        return ExpertsChoice("torch_grouped", "asked for" if requested == "torch_grouped" else
                             f"torch._grouped_mm runs {params_dtype} on {device}")
    if requested == "torch_grouped":
        raise ValueError(f"{key}: torch_grouped needs torch._grouped_mm for {params_dtype} with hidden "
                         f"{hidden} and expert FFN {ffn_local} on {device}: {why_not}")
    if te:
        return ExpertsChoice("te_grouped", f"torch._grouped_mm does not run {params_dtype} on {device} "
                                           f"({why_not}); Transformer Engine is installed")
    return ExpertsChoice("sequential", f"no Transformer Engine, and torch._grouped_mm does not run "
                                       f"{params_dtype} on {device}: {why_not}")


# --------------------------------------------------------------------------- the module
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense: `torch._grouped_mm`'s backward
    refuses the broadcast (stride 0) gradients that e.g. a `sum()` hands back (`contiguous()`
    keeps those of an empty tensor as they are, so they are cloned)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_contiguous() and 0 not in grad.stride():
            return grad
        return grad.clone(memory_format=torch.contiguous_format)


class TorchGroupedMLP(torch.nn.Module):
    """Megatron experts module (the constructor and `forward` contract of `SequentialMLP`): the local
    experts' gated FFNs as two `torch._grouped_mm` calls over the permuted tokens. A plain
    `nn.Module` (Megatron stays a lazy import): `MoELayer` only calls it, `backward_dw` and
    `sharded_state_dict`."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
        super().__init__()
        if config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("model.moe_experts: torch_grouped supports gated experts without biases "
                             "(add_bias_linear=False, gated_linear_unit=True)")
        self.config = config
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        etp = self.tp_group.size()
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        if ffn % etp:
            raise ValueError(f"etp: {etp} does not divide the expert FFN size {ffn}")
        self.fc1_weight = _expert_param(config, (num_local_experts, 2 * ffn // etp, hidden),
                                        partition_dim=1, init=config.init_method)
        self.fc2_weight = _expert_param(config, (num_local_experts, hidden, ffn // etp),
                                        partition_dim=2, init=config.output_layer_init_method)
        self.register_load_state_dict_post_hook(_drop_extra_states)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        probs = probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:  # as Megatron's experts modules do
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input: needs moe_router_topk=1")
            hidden = (probs * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        # group ends: Megatron's dispatchers hand the counts on the host, already valid there (its TE
        # experts read them with .tolist()); summed there and queued to the device, as a blocking copy
        # would make the host wait for the device to drain at every MoE layer of every micro-batch
        offs = to_device_queued(tokens_per_expert.cumsum(0, dtype=torch.int32), hidden.device)
        fc1 = _ContiguousGrad.apply(torch._grouped_mm(hidden, self.fc1_weight.transpose(1, 2), offs=offs))
        act = self._activation(fc1, probs)
        out = torch._grouped_mm(act, self.fc2_weight.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(out), None

    def _activation(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Megatron's MLP activation weighted by the routing probabilities, as SequentialMLP's experts
        compute it: its fused SwiGLU kernel where `bias_activation_fusion` is on (one rounding to
        bf16 instead of two, so the unfused expression would differ from it in bf16), else unfused."""
        import torch.nn.functional as F

        if self.config.bias_activation_fusion and self.config.activation_func is F.silu:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(fc1, None, probs, self.config.activation_func_fp8_input_store)
        return (self._glu(fc1) * probs).to(fc1.dtype)

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (val := self.config.activation_func_clamp_value) is not None:
            x_glu, x_linear = x_glu.clamp(max=val), x_linear.clamp(min=-val, max=val)
        return self.config.activation_func(x_glu) * (x_linear + self.config.glu_linear_offset)

    def backward_dw(self) -> None:
        """Weight gradients come in the ordinary backward (no delayed weight-gradient pass)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        if (metadata or {}).get("singleton_local_shards", False):
            raise ValueError("model.moe_experts: torch_grouped checkpoints use the global expert layout; "
                             "singleton_local_shards is not supported")
        # SequentialMLP's checkpoint keys and tensors (`{prefix}experts.linear_fc1.weight`, one global
        # [E, ...] tensor per layer), and its linears' empty extra states, so that either module
        # loads the other's checkpoint
        out = {f"{prefix}{name}": _stacked_expert_factory(self, f"{prefix}experts.{linear}.weight", name,
                                                          sharded_offsets)
               for name, linear in (("fc1_weight", "linear_fc1"), ("fc2_weight", "linear_fc2"))}
        out.update(_sequential_extra_states(self, prefix, sharded_offsets))
        return out


def _drop_extra_states(module, incompatible_keys) -> None:
    """Load post-hook: the `SequentialMLP` extra states of `sharded_state_dict` (always None) come
    back from a checkpoint load; this module has nowhere to put them."""
    for key in list(incompatible_keys.unexpected_keys):
        if _EXTRA_STATE_TAG in key:
            incompatible_keys.unexpected_keys.remove(key)


_EXTRA_STATE_TAG = ".local_experts_extra_state."


def _sequential_extra_states(module, prefix: str, sharded_offsets: tuple) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    num_local = module.num_local_experts
    first, num_global = module.ep_group.rank() * num_local, module.ep_group.size() * num_local
    # the offsets of Megatron's make_sharded_object_for_checkpoint: layer axes, then the expert axis
    offsets = tuple(o[1] for o in sharded_offsets), tuple(o[2] for o in sharded_offsets)
    replica_id = (0, module.tp_group.rank(), module.dp_group.rank())
    out = {}
    for i in range(num_local):
        for linear in ("linear_fc1", "linear_fc2"):
            out[f"{prefix}{_EXTRA_STATE_TAG[1:]}{i}.{linear}"] = ShardedObject(
                f"{prefix}experts.{linear}._extra_state", None, (*offsets[1], num_global),
                (*offsets[0], first + i), replica_id)
    return out


def experts_laid_out_apart(config) -> bool:
    """True when the routed experts' ranks are not the dense weights' (EP > 1, or expert TP != TP):
    their parameters then belong to Megatron's expert groups (`allreduce = False`: broadcast, gradient
    reduction and the optimizer's norm over expert-DP / expert-model-parallel). Megatron's own expert
    layers look at EP only, which at EP = 1 with expert TP != TP would sum the gradients of different
    expert-TP shards over DP and overwrite every shard with DP rank 0's at start."""
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    return config.expert_model_parallel_size > 1 or etp != config.tensor_model_parallel_size


def _expert_param(config, shape: tuple[int, ...], partition_dim: int, init) -> torch.nn.Parameter:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )

    device = "cpu" if config.use_cpu_initialization else current_device()
    param = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
    if config.perform_initialization:
        if config.use_cpu_initialization:
            init(param.data)
        else:  # expert weights draw from the expert-parallel RNG stream, as Megatron's do
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init(param.data)
    set_tensor_model_parallel_attributes(param, True, partition_dim, 1)
    # reduced over the expert-data-parallel group, not DP, once experts are laid out unlike the dense
    # weights: split over EP ranks, or over expert-TP ranks that are not the TP ranks
    param.allreduce = not experts_laid_out_apart(config)
    return param


def _stacked_expert_factory(module, key: str, name: str, sharded_offsets: tuple):
    """A `ShardedTensorFactory` saving stacked parameter `name` as `SequentialMLP` saves its experts:
    one global tensor [E, rows, cols] (after the layer axes) under `key`, expert i at global index
    ep_rank * E_local + i, split over expert TP; a gated fc1 in its gate and up halves."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    param = getattr(module, name)
    num_local = module.num_local_experts
    num_global = module.ep_group.size() * num_local
    first = module.ep_group.rank() * num_local
    tp_rank, tp_size = module.tp_group.rank(), module.tp_group.size()
    expert_axis = len(sharded_offsets)
    tp_axis = expert_axis + 1 + (0 if name == "fc1_weight" else 1)
    replica_id = (0, 0, module.dp_group.rank())  # (PP, TP, DP): replicated over expert DP only

    def shard(k, t, rid, i, tp_offset):
        return ShardedTensor.from_rank_offsets(
            k, t, *sharded_offsets, (expert_axis, first + i, num_global), tp_offset,
            replica_id=rid, prepend_axis_num=expert_axis + 1)

    @torch.no_grad()
    def build(k, t, rid, flattened_range):
        if flattened_range is not None:
            raise ValueError(f"{k}: flattened (distributed-optimizer) shards of stacked experts are "
                             f"not supported; use the dp_reshardable optimizer format")
        out = []
        for i in range(num_local):
            if name == "fc1_weight":  # [gate; up] of this TP rank: each half is its own TP shard
                gate, up = torch.chunk(t[i], 2, dim=0)
                out.append([shard(k, gate, rid, i, (tp_axis, tp_rank, 2 * tp_size)),
                            shard(k, up, rid, i, (tp_axis, tp_size + tp_rank, 2 * tp_size))])
            else:
                out.append([shard(k, t[i], rid, i, (tp_axis, tp_rank, tp_size))])
        return out

    def merge(sub):
        return torch.stack([torch.cat(parts, dim=0) for parts in sub])

    return ShardedTensorFactory(key, param, build, merge, replica_id)


def experts_spec(choice: ExpertsChoice):
    """The `ModuleSpec` of the experts submodule for torch_grouped (None: Megatron's own spec)."""
    if choice.impl != "torch_grouped":
        return None
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TorchGroupedMLP)

