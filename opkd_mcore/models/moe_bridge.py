"""HF <-> Megatron bridges for mixture-of-experts families: Qwen3-MoE, Mixtral, Qwen2-MoE.

Attention, norms, embeddings and the LM head are mapped exactly as for the dense families
(`bridge.ModelBridge`); only the MLP differs. Every decoder layer's MLP is Megatron's `MoELayer`:

| Megatron parameter (per layer)                       | HF tensor(s)                                    |
| ---------------------------------------------------- | ----------------------------------------------- |
| `mlp.router.weight` [E, H]                           | `{moe}.gate.weight` (replicated)                |
| `mlp.experts.local_experts.{i}.linear_fc1.weight`    | `{moe}.experts.{e}.{gate,up}` (expert_gate_up)  |
| `mlp.experts.local_experts.{i}.linear_fc2.weight`    | `{moe}.experts.{e}.{down}` (expert_row)         |
| `mlp.shared_experts.linear_fc1/linear_fc2.weight`    | `mlp.shared_expert.{gate,up,down}_proj` (Qwen2) |
| `mlp.shared_experts.gate_weight` [1, H]              | `mlp.shared_expert_gate.weight` (Qwen2)         |

`{moe}` is `mlp` (Qwen) or `block_sparse_moe` (Mixtral, whose experts are `w1`/`w3`/`w2` for
gate/up/down). The rules name the experts as `SequentialMLP` does; the grouped experts modules hold
the same per-expert matrices under other names (`local_expert_slot` maps every layout to the rule):

| experts module (`model.moe_experts`) | local expert `i`'s fc1 (fc2 alike)                     |
| ------------------------------------ | ------------------------------------------------------ |
| `sequential` (`SequentialMLP`)       | `mlp.experts.local_experts.{i}.linear_fc1.weight`      |
| `te_grouped` (`TEGroupedMLP`)        | `mlp.experts.linear_fc1.weight{i}`                     |
| `torch_grouped` (`TorchGroupedMLP`)  | `mlp.experts.fc1_weight[i]` (stacked [E_local, ...])   |
 Local expert `i` of EP rank `r` is global expert `e = r * E / ep + i`; its fc1/fc2
are split over the expert-tensor-parallel group like a dense MLP's over TP.

Routing: HF takes softmax over all E router logits, then the top-k; with `norm_topk_prob` (Mixtral
always, Qwen3-MoE as configured) the k weights are renormalised to sum to 1. Megatron's softmax
router gives the renormalised form when it takes the top-k of the logits first and the softmax over
those k (`moe_router_pre_softmax=False`), and HF's raw form with `moe_router_pre_softmax=True`.
The load-balancing loss is off unless the trainer asks for it (`moe_aux_loss_coeff`).
"""
from __future__ import annotations

import logging
import re

from opkd_mcore.models.bridge import ModelBridge, TensorRule

logger = logging.getLogger(__name__)

# HF config keys that only MoE configs have: an unsupported architecture carrying one of these is
# refused as an MoE architecture (so the message says what kind of model it is)
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "num_experts_per_tok")


def looks_like_moe(hf_config) -> bool:
    return any(getattr(hf_config, key, None) for key in _MOE_KEYS)


_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
STACKED_EXPERTS = {"mlp.experts.fc1_weight": "linear_fc1", "mlp.experts.fc2_weight": "linear_fc2"}
"""`TorchGroupedMLP`'s parameters (all local experts along dim 0) -> the linear they stack"""


def expert_rule_name(linear: str) -> str:
    """The tensor rule's Megatron name of a routed expert's `linear` (linear_fc1 | linear_fc2)."""
    return f"mlp.experts.local_experts.{{expert}}.{linear}.weight"


def local_expert_slot(name: str) -> tuple[str, int | None] | None:
    """(rule name, local expert index) of a routed expert's parameter `name` inside a layer, in any
    experts layout; index None for a stacked parameter (expert i is its slice [i]); None when `name`
    is not a routed expert's."""
    if (m := _SEQUENTIAL_EXPERT.match(name)):
        return expert_rule_name(m.group(2)), int(m.group(1))
    if (m := _TE_EXPERT.match(name)):
        return expert_rule_name(m.group(1)), int(m.group(2))
    if name in STACKED_EXPERTS:
        return expert_rule_name(STACKED_EXPERTS[name]), None
    return None


def expert_param_name(linear: str, local: int, impl: str) -> str:
    """The inverse of `local_expert_slot`: the parameter holding local expert `local`'s `linear` in
    the `impl` layout (torch_grouped: the stacked parameter, whose slice [local] it is)."""
    if impl == "sequential":
        return f"mlp.experts.local_experts.{local}.{linear}.weight"
    if impl == "te_grouped":
        return f"mlp.experts.{linear}.weight{local}"
    if impl == "torch_grouped":
        return next(k for k, v in STACKED_EXPERTS.items() if v == linear)
    raise ValueError(f"model.moe_experts: no parameter layout for {impl!r}")


class MoEBridge(ModelBridge):
    """Decoder whose every layer's MLP is routed experts (+ an optional gated shared expert)."""

    is_moe = True
    moe_prefix = "mlp"  # HF module holding router + experts
    expert_names = ("gate_proj", "up_proj", "down_proj")  # HF names of one expert's gate, up, down
    num_experts_key = "num_experts"
    expert_size_key = "moe_intermediate_size"
    always_norm_topk = False  # Mixtral renormalises unconditionally
    shared_expert = False  # Qwen2-MoE: one shared expert behind a sigmoid gate

    # ---------------------------------------------------------------- config
    @property
    def num_experts(self) -> int:
        return int(getattr(self.hf_config, self.num_experts_key))

    @property
    def top_k(self) -> int:
        return int(self.hf_config.num_experts_per_tok)

    @property
    def expert_ffn_size(self) -> int:
        return int(getattr(self.hf_config, self.expert_size_key))

    @property
    def shared_ffn_size(self) -> int | None:
        return int(self.hf_config.shared_expert_intermediate_size) if self.shared_expert else None

    @property
    def norm_topk_prob(self) -> bool:
        return self.always_norm_topk or bool(getattr(self.hf_config, "norm_topk_prob", False))

    def _check_config(self) -> None:
        super()._check_config()
        c = self.hf_config
        for key in (self.num_experts_key, "num_experts_per_tok", self.expert_size_key):
            if not isinstance(getattr(c, key, None), int) or getattr(c, key) < 1:
                raise ValueError(f"{key}: the {self.family} bridge needs a positive int, got "
                                 f"{getattr(c, key, None)!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.top_k} exceeds the {self.num_experts} experts")
        # Qwen MoE configs can interleave dense MLP layers; every layer here is an MoE layer
        step = getattr(c, "decoder_sparse_step", 1)
        dense_layers = list(getattr(c, "mlp_only_layers", None) or [])
        if step != 1 or dense_layers:
            raise ValueError(f"decoder_sparse_step/mlp_only_layers: the {self.family} bridge needs every "
                             f"layer to be an MoE layer (decoder_sparse_step=1, mlp_only_layers=[]), "
                             f"got {step} and {dense_layers}")
        if self.shared_expert and not getattr(c, "shared_expert_intermediate_size", 0):
            raise ValueError("shared_expert_intermediate_size: Qwen2-MoE needs a positive shared "
                             "expert size")
        jitter = getattr(c, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            logger.warning("router_jitter_noise=%g: HF's training-time jitter is not applied here "
                           "(inference is identical)", jitter)

    def tp_divided_sizes(self) -> tuple[tuple[str, int], ...]:
        sizes = [s for s in super().tp_divided_sizes() if s[0] != "intermediate_size"]
        if self.shared_expert:
            sizes.append(("shared_expert_intermediate_size", self.shared_ffn_size))
        return tuple(sizes)

    def check_parallel(self, tp: int, pp: int, vpp: int | None, ep: int = 1,
                       etp: int | None = None) -> None:
        super().check_parallel(tp, pp, vpp, ep, etp)
        if self.num_experts % ep:
            raise ValueError(f"ep: {ep} does not divide the model's {self.num_experts} experts "
                             f"({self.num_experts_key})")
        etp = tp if etp is None else etp
        if self.expert_ffn_size % etp:
            raise ValueError(f"etp: expert tensor-parallel size {etp} does not divide "
                             f"{self.expert_size_key}={self.expert_ffn_size}")

    def transformer_config_kwargs(self) -> dict:
        kwargs = super().transformer_config_kwargs()
        kwargs.update(
            num_moe_experts=self.num_experts, moe_router_topk=self.top_k,
            moe_ffn_hidden_size=self.expert_ffn_size,
            # SequentialMLP copies the config when the sizes differ; every layer is MoE anyway
            ffn_hidden_size=self.expert_ffn_size,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not self.norm_topk_prob,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            # TEGroupedMLP only; build_model sets it from the experts decision (model.moe_experts)
            moe_grouped_gemm=False,
            # all-to-all exchanges only the routed tokens; every process-group backend carries it
            moe_token_dispatcher_type="alltoall",
            # capacity-free routing: every token reaches its k experts (no drops, no padding), as in HF
            moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
            moe_shared_expert_intermediate_size=self.shared_ffn_size,
            moe_shared_expert_gate=self.shared_expert,
        )
        return kwargs

    # ---------------------------------------------------------------- tensors
    def layer_rules(self) -> list[TensorRule]:
        p = "model.layers.{layer}."
        m = p + self.moe_prefix + "."
        gate, up, down = (m + "experts.{expert}." + n + ".weight" for n in self.expert_names)
        rules = [r for r in super().layer_rules() if not r.megatron.startswith("mlp.")]
        rules += [
            TensorRule("mlp.router.weight", (m + "gate.weight",), "replicated"),
            TensorRule(expert_rule_name("linear_fc1"), (gate, up), "expert_gate_up"),
            TensorRule(expert_rule_name("linear_fc2"), (down,), "expert_row"),
        ]
        if self.shared_expert:
            s = p + "mlp.shared_expert."
            rules += [
                TensorRule("mlp.shared_experts.linear_fc1.weight",
                           (s + "gate_proj.weight", s + "up_proj.weight"), "gate_up"),
                TensorRule("mlp.shared_experts.linear_fc2.weight", (s + "down_proj.weight",), "row"),
                TensorRule("mlp.shared_experts.gate_weight", (p + "mlp.shared_expert_gate.weight",),
                           "replicated"),
            ]
        return rules

    def hf_layer_shapes(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """Attention as the dense families, then router, experts 0..E-1, shared expert."""
        h, f = self.hf_config.hidden_size, self.expert_ffn_size
        p = f"model.layers.{layer}."
        m = p + self.moe_prefix + "."
        out = [s for s in super().hf_layer_shapes(layer) if ".mlp." not in s[0]]
        out.append((m + "gate.weight", (self.num_experts, h)))
        gate, up, down = self.expert_names
        for e in range(self.num_experts):
            out += [(f"{m}experts.{e}.{gate}.weight", (f, h)), (f"{m}experts.{e}.{up}.weight", (f, h)),
                    (f"{m}experts.{e}.{down}.weight", (h, f))]
        if self.shared_expert:
            fs, s = self.shared_ffn_size, p + "mlp.shared_expert."
            out += [(s + "gate_proj.weight", (fs, h)), (s + "up_proj.weight", (fs, h)),
                    (s + "down_proj.weight", (h, fs)), (p + "mlp.shared_expert_gate.weight", (1, h))]
        return out

    @staticmethod
    def expert_of(hf_name: str) -> int | None:
        """Global expert index of a routed expert's HF tensor name, None for every other tensor."""
        parts = hf_name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return int(parts[i + 1])
        return None


class Qwen3MoeBridge(MoEBridge):
    family = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    qk_norm = True


class MixtralBridge(MoEBridge):
    family = "mixtral"
    architectures = ("MixtralForCausalLM",)
    moe_prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    num_experts_key = "num_local_experts"
    expert_size_key = "intermediate_size"
    always_norm_topk = True


class Qwen2MoeBridge(MoEBridge):
    family = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    shared_expert = True

    def __init__(self, hf_config):
        # Qwen2-MoE switches its q/k/v biases with a config flag (on in every released model)
        self.qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        super().__init__(hf_config)

    def _check_config(self) -> None:
        super()._check_config()
        c = self.hf_config
        if self.head_dim * c.num_attention_heads != c.hidden_size:
            # transformers honours head_dim; vLLM's Qwen2-MoE (0.32) uses hidden_size / heads
            logger.warning("head_dim=%d differs from hidden_size/num_attention_heads=%d: Megatron and "
                           "transformers use head_dim, but vLLM's Qwen2-MoE does not, so a vLLM engine "
                           "of this checkpoint (rollout, teacher) computes another model",
                           self.head_dim, c.hidden_size // c.num_attention_heads)


MOE_BRIDGES = (Qwen3MoeBridge, MixtralBridge, Qwen2MoeBridge)
