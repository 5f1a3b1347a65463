"""HF <-> Megatron bridges: per model family, config mapping and tensor names/layouts.

A bridge knows, for one family (Llama 3.x, Qwen2/2.5, Qwen3 dense, Mistral; the MoE families
Qwen3-MoE, Mixtral and Qwen2-MoE live in `moe_bridge.py`):

* how an HF config becomes a Megatron `TransformerConfig` (+ GPTModel arguments),
* which HF tensors make each Megatron parameter and how (`TensorRule.kind`):
  ``replicated`` (norms), ``vocab`` (rows split over TP, padded), ``row`` (input dim split over TP),
  ``qkv`` (q/k/v fused per query group, groups split over TP), ``gate_up`` (gate and up each split
  over TP, then stacked per rank); MoE adds ``expert_gate_up`` / ``expert_row`` (the same layouts
  for one routed expert, split over the expert-TP group; HF names carry ``{expert}``),
* the HF tensor list of the full model with shapes (for metadata listed without moving tensors).

The registry maps HF `architectures[0]` to a bridge; `get_bridge` raises a `ValueError` naming the
architecture and the supported ones.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class TensorRule:
    """How one Megatron parameter is made from HF tensors.

    `megatron` is the parameter name inside a layer (``self_attention.linear_qkv.weight``) or in the
    model (``embedding.word_embeddings.weight``); `hf` are HF name templates with ``{layer}``.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str  # replicated | vocab | row | qkv | gate_up | expert_gate_up | expert_row

    @property
    def is_expert(self) -> bool:
        """A routed expert's weight: one per expert, held by its EP rank, split over expert TP."""
        return self.kind.startswith("expert_")


class ModelBridge:
    """Llama-style decoder (RMSNorm, SwiGLU, RoPE, GQA); families override the flags below."""

    family = "llama"
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    qkv_bias = False  # Qwen2: biases on q/k/v projections
    qk_norm = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    is_moe = False  # routed experts (moe_bridge.py)

    def __init__(self, hf_config):
        self.hf_config = hf_config
        self._check_config()

    # ---------------------------------------------------------------- config
    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def num_query_groups(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    def rope_parameters(self) -> dict:
        c = self.hf_config
        params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        params.setdefault("rope_type", params.get("type", "default"))
        if "rope_theta" not in params:
            params["rope_theta"] = getattr(c, "rope_theta", 10000.0)
        return params

    def _check_config(self) -> None:
        c = self.hf_config
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: {self.family} bridge supports 'silu' (SwiGLU), got {act!r}")
        for key in ("attention_bias", "mlp_bias"):
            # Qwen2 has q/k/v biases by design (no flag); other biases have no mapping here
            if getattr(c, key, False) and not (key == "attention_bias" and self.qkv_bias):
                raise ValueError(f"{key}: True is not supported by the {self.family} bridge")
        rope_type = self.rope_parameters()["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type: expected one of {SUPPORTED_ROPE_TYPES}, "
                             f"got {rope_type!r}")
        if c.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_key_value_heads: {self.num_query_groups} does not divide "
                             f"num_attention_heads {c.num_attention_heads}")
        window = getattr(c, "sliding_window", None)
        if window and getattr(c, "use_sliding_window", True) and window < c.max_position_embeddings:
            logger.warning("sliding_window=%d: attention here is full causal, identical to the HF "
                           "model only for sequences of at most %d tokens", window, window)

    def tp_divided_sizes(self) -> tuple[tuple[str, int], ...]:
        """HF config sizes that the (attention/dense) TP size must divide."""
        c = self.hf_config
        return (("num_attention_heads", c.num_attention_heads),
                ("num_key_value_heads", self.num_query_groups),
                ("intermediate_size", c.intermediate_size))

    def check_parallel(self, tp: int, pp: int, vpp: int | None, ep: int = 1,
                       etp: int | None = None) -> None:
        """Raise naming the size that does not fit. A dense model ignores ep/etp: it may share a
        job's expert-parallel groups with an MoE model (e.g. a dense teacher of an MoE student)."""
        c = self.hf_config
        for name, value in self.tp_divided_sizes():
            if value % tp:
                raise ValueError(f"tp: {tp} does not divide {name}={value} of the model")
        chunks = pp * (vpp or 1)
        if c.num_hidden_layers % chunks:
            raise ValueError(f"pp/vpp: num_hidden_layers={c.num_hidden_layers} is not divisible by "
                             f"pp*vpp = {pp}*{vpp or 1}")

    def transformer_config_kwargs(self) -> dict:
        """Megatron `TransformerConfig` fields that follow from the HF config."""
        c = self.hf_config
        return dict(
            num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads, num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim, ffn_hidden_size=c.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm,
            hidden_dropout=0.0, attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
            init_method_std=getattr(c, "initializer_range", 0.02),
        )

    # ---------------------------------------------------------------- tensors
    def layer_rules(self) -> list[TensorRule]:
        p = "model.layers.{layer}."
        rules = [
            TensorRule("input_layernorm.weight", (p + "input_layernorm.weight",), "replicated"),
            TensorRule("self_attention.linear_qkv.weight",
                       (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                        p + "self_attn.v_proj.weight"), "qkv"),
            TensorRule("self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), "row"),
            TensorRule("pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
            TensorRule("mlp.linear_fc1.weight",
                       (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "gate_up"),
            TensorRule("mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "row"),
            # Transformer Engine spec: the norms are fused into the following linear layers
            TensorRule("self_attention.linear_qkv.layer_norm_weight",
                       (p + "input_layernorm.weight",), "replicated"),
            TensorRule("mlp.linear_fc1.layer_norm_weight",
                       (p + "post_attention_layernorm.weight",), "replicated"),
        ]
        if self.qkv_bias:
            rules.append(TensorRule("self_attention.linear_qkv.bias",
                                    (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                     p + "self_attn.v_proj.bias"), "qkv"))
        if self.qk_norm:
            rules += [TensorRule("self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",),
                                 "replicated"),
                      TensorRule("self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",),
                                 "replicated")]
        return rules

    def model_rules(self) -> list[TensorRule]:
        lm_head = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        return [
            TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
            TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
            TensorRule("output_layer.weight", (lm_head,), "vocab"),
        ]

    def hf_layer_shapes(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """HF tensors of one decoder layer, in export order, with full shapes."""
        c = self.hf_config
        h, d, f = c.hidden_size, self.head_dim, c.intermediate_size
        q, kv = c.num_attention_heads * d, self.num_query_groups * d
        p = f"model.layers.{layer}."
        out = [(p + "input_layernorm.weight", (h,)),
               (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
               (p + "self_attn.v_proj.weight", (kv, h))]
        if self.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if self.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        out += [(p + "self_attn.o_proj.weight", (h, q)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
        return out


class Qwen2Bridge(ModelBridge):
    family = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True


class Qwen3Bridge(ModelBridge):
    family = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True


class MistralBridge(ModelBridge):
    family = "mistral"
    architectures = ("MistralForCausalLM",)


# imported here, after ModelBridge exists: the MoE bridges subclass it, and every registration
# stays in this one table
from opkd_mcore.models.moe_bridge import MOE_BRIDGES, looks_like_moe

BRIDGES: dict[str, type[ModelBridge]] = {
    arch: cls for cls in (ModelBridge, Qwen2Bridge, Qwen3Bridge, MistralBridge, *MOE_BRIDGES)
    for arch in cls.architectures
}


def get_bridge(hf_config) -> ModelBridge:
    """The bridge for the config's architecture; `ValueError` naming it when unsupported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise ValueError("architectures: the HF config lists no architecture; expected one of "
                         f"{sorted(BRIDGES)}")
    if archs[0] not in BRIDGES:
        if looks_like_moe(hf_config):
            moe = sorted(a for cls in MOE_BRIDGES for a in cls.architectures)
            raise ValueError(f"architectures: the mixture-of-experts architecture {archs[0]!r} is "
                             f"not supported; supported MoE architectures: {moe}")
        raise ValueError(f"architectures: {archs[0]!r} is not supported; supported: {sorted(BRIDGES)}")
    return BRIDGES[archs[0]](hf_config)


def hf_inv_freq(bridge: ModelBridge) -> torch.Tensor:
    """RoPE inverse frequencies exactly as `transformers` computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = bridge.rope_parameters()
    d = bridge.head_dim
    if params["rope_type"] == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](bridge.hf_config, None)
    if attention_scaling != 1.0:
        raise ValueError(f"rope_scaling: attention scaling {attention_scaling} is not supported")
    return inv_freq.float()
