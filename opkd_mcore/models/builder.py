"""HF config -> Megatron `TransformerConfig` + layer spec -> `GPTModel` chunks for this rank.

Needs `opkd_mcore.platform.init_parallel` first (reads TP/PP/VPP from Megatron's parallel_state).
Each chunk carries a `ModelLayout` (attribute `opkd_layout`) that the weight loader/exporter and the
trainer read: the bridge, the true and padded vocabulary sizes, and where every layer lives.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from opkd_mcore.config.schema import RECOMPUTE_MODES
from opkd_mcore.models.bridge import ModelBridge, get_bridge, hf_inv_freq
from opkd_mcore.models.grouped_experts import (
    ExpertsChoice,
    experts_laid_out_apart,
    experts_spec,
    resolve_experts,
)
from opkd_mcore.models.te_support import transformer_engine_usable
from opkd_mcore.platform import current_device, is_cpu, megatron_thd_rope
from opkd_mcore.platform.megatron_moe import prepare_megatron_moe
from opkd_mcore.platform.sdpa_attention import SdpaCoreAttention

logger = logging.getLogger(__name__)


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(hf_dir: str):
    """The `transformers` config of a local HF checkpoint; clear errors for a bad directory."""
    from transformers import AutoConfig

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hf_dir: no config.json in {hf_dir!r}")
    with open(path) as f:
        raw = json.load(f)
    if "model_type" not in raw:
        raise ValueError(f"hf_dir: {path} has no 'model_type'")
    return AutoConfig.from_pretrained(hf_dir)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    """Vocabulary rounded up so every TP rank holds an equal, `divisible_by`-aligned shard."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass
class ModelLayout:
    """Where the model's pieces live; identical on every rank (computed from config + layout)."""

    bridge: ModelBridge
    tp: int
    pp: int
    vpp: int | None
    vocab_size: int  # the HF vocabulary
    padded_vocab_size: int  # rows of the Megatron embedding/output layer (all TP ranks together)
    pp_rank: int
    vp_stage: int | None  # this chunk's virtual stage (None without VPP)
    ep: int = 1  # expert-parallel size (MoE): each EP rank holds num_experts / ep routed experts
    etp: int = 1  # expert tensor-parallel size (splits each expert's FFN like TP a dense MLP)
    ep_rank: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.bridge.num_experts // self.ep if self.bridge.is_moe else 0

    def expert_owner(self, expert: int) -> int:
        """EP rank holding global routed expert `expert`."""
        return expert // self.num_local_experts

    @property
    def num_layers(self) -> int:
        return self.bridge.hf_config.num_hidden_layers

    def layer_stage(self, layer: int) -> int:
        """PP stage holding global layer `layer` (Megatron's interleaved assignment with VPP)."""
        chunks = self.pp * (self.vpp or 1)
        return (layer // (self.num_layers // chunks)) % self.pp


def layer_spec(bridge: ModelBridge, use_te: bool | None = None, experts: ExpertsChoice | None = None):
    """Transformer Engine spec when TE is usable, else Megatron's local spec with SDPA attention; an
    MoE model's experts submodule as `experts` decided (`grouped_experts.resolve_experts`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = transformer_engine_usable() if use_te is None else use_te
    # unfused packed-sequence RoPE (no TE, or TE without rope fusion) without Megatron's host syncs
    megatron_thd_rope.install()
    num_experts = bridge.num_experts if bridge.is_moe else None
    if bridge.is_moe:
        prepare_megatron_moe()
    experts = experts or ExpertsChoice("sequential", "no decision given")
    grouped = experts.grouped_gemm  # TEGroupedMLP; otherwise SequentialMLP, replaced below if torch_grouped
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped, qk_layernorm=bridge.qk_norm)
    else:
        if grouped:
            raise ValueError("model.moe_experts: te_grouped needs the Transformer Engine layer spec")
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                        qk_layernorm=bridge.qk_norm,
                                                        normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    if bridge.is_moe and experts_spec(experts) is not None:
        spec.submodules.mlp.submodules.experts = experts_spec(experts)
    return spec


def resolve_model_experts(bridge: ModelBridge, requested: str, params_dtype: torch.dtype,
                          etp: int = 1) -> ExpertsChoice | None:
    """The experts module of an MoE model (None for a dense one), decided and logged once."""
    if not bridge.is_moe:
        return None
    choice = resolve_experts(requested, params_dtype, bridge.hf_config.hidden_size,
                             bridge.expert_ffn_size // etp)
    logger.info("%s experts: %s (model.moe_experts=%s: %s)", bridge.family, choice.impl, requested,
                choice.reason)
    return choice


def kernel_fusions(use_te: bool, moe: bool = False) -> dict:
    """Megatron's fused SwiGLU and fused RoPE (`TransformerConfig` fields), on where the Transformer
    Engine spec builds the model: the fused RoPE is TE's kernel (packed sequences through their
    cu_seqlens), and together they take ~13% off a training step (`docs/benchmarks.md`, Training step).
    An MoE model (`moe`) also gets Megatron's fused token permutation and fused top-k router there (TE's
    kernels; 1.11x on an EP=1 step, "MoE student"). Without TE all stay unfused, which is exact
    everywhere (on CPU the fused SwiGLU would only be a `torch.compile` of the same expression)."""
    fusions = dict(bias_activation_fusion=use_te, apply_rope_fusion=use_te)
    if moe:
        fusions.update(moe_permute_fusion=use_te, moe_router_fusion=use_te)
    return fusions


def transformer_config(bridge: ModelBridge, params_dtype: torch.dtype, use_te: bool = False, **overrides):
    """Megatron `TransformerConfig` for the bridge's HF config and the current parallel layout;
    `use_te`: the model is built on the Transformer Engine spec (`kernel_fusions`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    kwargs = bridge.transformer_config_kwargs()
    kwargs.update(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        use_cpu_initialization=is_cpu(),
        # off: the gradient-accumulation fusion needs apex's kernels; the other three have nothing to
        # fuse in these layers (no output-projection bias or dropout; SDPA's or TE's softmax and norms)
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, **kernel_fusions(use_te, bridge.is_moe),
    )
    kwargs.update(overrides)
    if kwargs.get("moe_aux_loss_coeff"):
        if not bridge.is_moe:
            raise ValueError(f"moe_aux_loss_coeff: {bridge.family} is not an MoE model")
        # a coefficient asks for Megatron's switch-style load-balancing loss in every router
        if "moe_router_load_balancing_type" not in overrides:
            kwargs["moe_router_load_balancing_type"] = "aux_loss"
    return TransformerConfig(**kwargs)


def memory_overrides(recompute: str = "none", sequence_parallel: bool = False) -> dict:
    """`TransformerConfig` fields for `parallel.recompute` and `parallel.sequence_parallel`, for the
    student only: a teacher runs no backward, so it has no activations to recompute."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: expected one of {list(RECOMPUTE_MODES)}, got {recompute!r}")
    overrides = {"sequence_parallel": True} if sequence_parallel else {}
    if recompute == "selective":  # Megatron's default selective module: the core attention
        overrides.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute == "full":  # every layer's input kept, its forward run again in backward
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return overrides


def default_params_dtype() -> torch.dtype:
    return torch.float32 if is_cpu() else torch.bfloat16


def build_model(hf_config, *, params_dtype: torch.dtype | None = None,
                make_vocab_size_divisible_by: int = 1, use_te: bool | None = None,
                padded_vocab: int | None = None, moe_experts: str = "auto", **config_overrides) -> list:
    """GPTModel chunks of this rank (one per VPP chunk, a single one without VPP).

    `params_dtype` defaults to fp32 on CPU and bf16 on accelerators. The vocabulary is padded to a
    multiple of `make_vocab_size_divisible_by * tp`; the padded rows are zero after loading and are
    dropped on export (`ModelLayout.vocab_size` is the real size). `padded_vocab` pads to exactly that
    many rows instead (a student and its teacher share one vocabulary layout that way). `moe_experts`
    (`grouped_experts.MOE_EXPERTS`) picks an MoE model's experts module. Extra keyword
    arguments override `TransformerConfig` fields (e.g. `recompute_granularity`).
    """
    from megatron.core import parallel_state as ps

    bridge = get_bridge(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    bridge.check_parallel(tp, pp, vpp, ep, etp)
    dtype = params_dtype or default_params_dtype()
    use_te = transformer_engine_usable() if use_te is None else use_te
    if config_overrides.get("sequence_parallel") and not use_te:
        raise ValueError("sequence_parallel: needs the Transformer Engine layer spec; the local "
                         "spec's torch norms do not support it")
    if ps.get_context_parallel_world_size() > 1 and not use_te:
        raise ValueError(f"context_parallel_size: {ps.get_context_parallel_world_size()} needs the "
                         "Transformer Engine layer spec (parallel.cp > 1); the local spec's SDPA attention "
                         "has no CP")
    experts = resolve_model_experts(bridge, moe_experts, dtype, etp)
    if experts is not None:
        config_overrides.setdefault("moe_grouped_gemm", experts.grouped_gemm)
    config = transformer_config(bridge, dtype, use_te, **config_overrides)
    spec = layer_spec(bridge, use_te, experts)
    padded = padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by)
    if padded_vocab is not None:
        if padded_vocab < hf_config.vocab_size or padded_vocab % tp:
            raise ValueError(f"padded_vocab: expected a multiple of tp={tp} that is >= the vocabulary "
                             f"{hf_config.vocab_size}, got {padded_vocab}")
        padded = padded_vocab
    chunks = []
    for vp_stage in (range(vpp) if vpp else [None]):
        model = _make_chunk(config, spec, bridge, padded, vp_stage)
        model.opkd_layout = ModelLayout(bridge, tp, pp, vpp, hf_config.vocab_size, padded,
                                        ps.get_pipeline_model_parallel_rank(), vp_stage, ep, etp,
                                        ps.get_expert_model_parallel_rank())
        chunks.append(model)
    logger.info("built %s: %d chunk(s), tp=%d pp=%d vpp=%s ep=%d etp=%d, vocab %d (padded %d), dtype %s",
                bridge.family, len(chunks), tp, pp, vpp, ep, etp, hf_config.vocab_size, padded, dtype)
    return chunks


def _make_chunk(config, spec, bridge: ModelBridge, padded_vocab: int, vp_stage: int | None):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=padded_vocab,
        max_sequence_length=bridge.hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True, share_embeddings_and_output_weights=bridge.tied,
        position_embedding_type="rope", rotary_base=int(bridge.rope_parameters()["rope_theta"]),
        vp_stage=vp_stage,
    )
    # Megatron's torch norms are created in fp32 on the CPU whatever params_dtype and device say;
    # Megatron's own training moves and casts the whole model, so do the same here
    model.to(device=current_device(), dtype=config.params_dtype)
    if experts_laid_out_apart(config):
        _mark_expert_params(model)
    if hasattr(model, "rotary_pos_emb"):
        # HF's frequencies (incl. llama3/linear scaling) replace Megatron's, so RoPE is identical
        model.rotary_pos_emb.inv_freq = hf_inv_freq(bridge).to(current_device())
    return model


def _mark_expert_params(model) -> None:
    """Every routed expert's parameters are expert-parallel (`experts_laid_out_apart`): Megatron's
    SequentialMLP / TEGroupedMLP mark them by EP alone, so expert TP at EP = 1 would leave them dense."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False


def layout_of(model_chunks) -> ModelLayout:
    """The `ModelLayout` of chunks made by `build_model` (unwraps DDP/Float16 wrappers)."""
    chunk = unwrap(model_chunks[0])
    layout = getattr(chunk, "opkd_layout", None)
    if layout is None:
        raise ValueError("model_chunks: not built by opkd_mcore.models.build_model (no opkd_layout)")
    return layout


def unwrap(module):
    """The GPTModel inside Megatron's DDP / Float16Module wrappers."""
    while not hasattr(module, "opkd_layout") and hasattr(module, "module"):
        module = module.module
    return module
