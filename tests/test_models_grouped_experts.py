"""Grouped-GEMM experts (`models/grouped_experts.py`) against Megatron's `SequentialMLP` and HF.

One rank in this process (gloo): the experts module alone against `SequentialMLP` holding the same
weights (outputs and gradients), then tiny Qwen3-MoE / Qwen2-MoE / Mixtral checkpoints loaded into
a `torch_grouped` student (logits against `transformers`, export bitwise against the checkpoint,
a dist checkpoint saved from one layout and loaded into the other). The experts-module decision
and the parameter-name mapping of every layout (Transformer Engine's included) are pure functions.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
from opkd_mcore.models.bridge import get_bridge
from opkd_mcore.models.convert import load_mcore_model, save_mcore_checkpoint
from opkd_mcore.models.grouped_experts import ExpertsChoice, TorchGroupedMLP, resolve_experts
from opkd_mcore.models.moe_bridge import expert_param_name, expert_rule_name, local_expert_slot
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model, tiny_hf_config
from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel
from tests.test_models_moe import BATCH, SEQ_LEN, _export_mismatches, moe_shape
from tests.test_models_parity import hf_logits, pipeline_logits


# ----------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("impl", ["sequential", "te_grouped"])
@pytest.mark.parametrize("linear", ["linear_fc1", "linear_fc2"])
def test_per_expert_names_round_trip(impl, linear):
    for local in (0, 3, 17):
        name = expert_param_name(linear, local, impl)
        assert local_expert_slot(name) == (expert_rule_name(linear), local)
    assert expert_param_name("linear_fc1", 5, "te_grouped") == "mlp.experts.linear_fc1.weight5"
    assert expert_param_name("linear_fc2", 2, "sequential") == \
        "mlp.experts.local_experts.2.linear_fc2.weight"


def test_stacked_names_map_to_every_expert():
    assert local_expert_slot("mlp.experts.fc1_weight") == (expert_rule_name("linear_fc1"), None)
    assert local_expert_slot("mlp.experts.fc2_weight") == (expert_rule_name("linear_fc2"), None)
    assert expert_param_name("linear_fc2", 4, "torch_grouped") == "mlp.experts.fc2_weight"
    for other in ("mlp.router.weight", "mlp.shared_experts.linear_fc1.weight",
                  "mlp.experts.linear_fc1.bias0", "self_attention.linear_qkv.weight"):
        assert local_expert_slot(other) is None


def test_te_names_follow_the_hf_experts_of_each_ep_rank():
    """TE's weight{i} of EP rank r maps to HF expert r * E_local + i, and back."""
    bridge = get_bridge(tiny_hf_config("mixtral", TinyModelShape()))
    rules = {r.megatron: r for r in bridge.layer_rules()}
    e_local = bridge.num_experts // 2
    for ep_rank in range(2):
        for i in range(e_local):
            rule_name, local = local_expert_slot(f"mlp.experts.linear_fc1.weight{i}")
            hf = [t.format(layer=1, expert=ep_rank * e_local + local) for t in rules[rule_name].hf]
            e = ep_rank * e_local + i
            assert hf == [f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight",
                          f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"]
            assert bridge.expert_of(hf[0]) == e and e // e_local == ep_rank


@pytest.mark.skipif(torch.cuda.is_available(), reason="the decisions of a CPU machine")
def test_decision_on_cpu():
    auto = resolve_experts("auto", torch.float32, 64, 64)
    assert auto == ExpertsChoice("torch_grouped", auto.reason) and "torch._grouped_mm" in auto.reason
    assert resolve_experts("sequential", torch.float32, 64, 64).impl == "sequential"
    # float64 has no grouped GEMM: auto falls back and says why, an explicit choice is an error
    fallback = resolve_experts("auto", torch.float64, 64, 64)
    assert fallback.impl == "sequential" and "float64" in fallback.reason
    with pytest.raises(ValueError, match=r"model\.moe_experts: torch_grouped needs torch\._grouped_mm"):
        resolve_experts("torch_grouped", torch.float64, 64, 64)
    with pytest.raises(ValueError, match=r"model\.moe_experts: te_grouped needs Transformer Engine"):
        resolve_experts("te_grouped", torch.float32, 64, 64)
    with pytest.raises(ValueError, match=r"model\.moe_experts: expected one of"):
        resolve_experts("grouped", torch.float32, 64, 64)
    # rows of 10 float32 (40 bytes) are not 16-byte aligned
    assert resolve_experts("auto", torch.float32, 10, 64).impl == "sequential"


# ----------------------------------------------------------------------------- one rank
@pytest.fixture
def one_rank():

    init_parallel(ParallelConfig(seed=3))
    yield
    destroy_parallel()


def _experts_pair(num_experts=4, hidden=32, ffn=48, fusion=False):
    """(SequentialMLP, TorchGroupedMLP) of one config, the grouped one holding the same weights."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module


    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                               ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, num_moe_experts=num_experts,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bias_activation_fusion=fusion, use_cpu_initialization=True,
                               moe_router_topk=2, params_dtype=torch.float32)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    seq_spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    sequential = build_module(seq_spec.submodules.experts, num_experts, config, pg_collection=pgs)
    grouped = TorchGroupedMLP(num_experts, config, pg_collection=pgs)
    with torch.no_grad():
        for i, expert in enumerate(sequential.local_experts):
            grouped.fc1_weight[i].copy_(expert.linear_fc1.weight)
            grouped.fc2_weight[i].copy_(expert.linear_fc2.weight)
    return sequential, grouped


# fusion: Megatron's fused SwiGLU in SequentialMLP's experts (on where TE builds the model), which the
# grouped experts take too
@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "fused_swiglu"])
def test_grouped_experts_equal_sequential_mlp(one_rank, fusion):
    sequential, grouped = _experts_pair(fusion=fusion)
    gen = torch.Generator().manual_seed(0)
    tokens_per_expert = torch.tensor([5, 0, 9, 3])  # an expert without tokens too
    x = torch.randn(17, 32, generator=gen)
    probs = torch.rand(17, generator=gen)
    grad_out = torch.randn(17, 32, generator=gen)
    outs = []
    for module in (sequential, grouped):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, bias = module(xi, tokens_per_expert, pi)
        assert bias is None
        y.backward(grad_out)
        outs.append((y.detach(), xi.grad, pi.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for i, expert in enumerate(sequential.local_experts):
        torch.testing.assert_close(grouped.fc1_weight.grad[i], expert.linear_fc1.weight.grad,
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grouped.fc2_weight.grad[i], expert.linear_fc2.weight.grad,
                                   rtol=1e-5, atol=1e-6)
    assert grouped.fc1_weight.grad[1].abs().sum() == 0  # no tokens, zero gradient (not None)


def test_grouped_experts_take_sequential_mlps_fused_activation(one_rank):
    """In bf16 the fused SwiGLU rounds once where the unfused expression rounds twice: the grouped
    experts' activation must be the very kernel SequentialMLP's experts call (bitwise)."""
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    _, grouped = _experts_pair(fusion=True)
    gen = torch.Generator().manual_seed(1)
    fc1 = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    probs = torch.rand(64, 1, generator=gen)
    assert torch.equal(grouped._activation(fc1, probs), weighted_bias_swiglu_impl(fc1, None, probs))


def test_grouped_experts_without_tokens(one_rank):
    _, grouped = _experts_pair()
    x = torch.zeros(0, 32, requires_grad=True)
    y, _ = grouped(x, torch.zeros(4, dtype=torch.long), torch.zeros(0))
    y.sum().backward()
    assert y.shape == (0, 32) and grouped.fc1_weight.grad.abs().sum() == 0


def test_expert_parameters_carry_megatron_attributes(one_rank):
    _, grouped = _experts_pair()
    for param, dim in ((grouped.fc1_weight, 1), (grouped.fc2_weight, 2)):
        assert param.tensor_model_parallel and param.partition_dim == dim
        assert param.allreduce is True  # ep = 1: reduced over the whole DP group, as SequentialMLP's


# ----------------------------------------------------------------------------- whole models, one rank
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):

    root = tmp_path_factory.mktemp("hf_grouped")
    return {f: save_tiny_hf_model(str(root / f), f, moe_shape(f), seed=5) for f in FAMILIES}


def _student(hf_dir: str, moe_experts: str):

    chunks = build_model(load_hf_config(hf_dir), moe_experts=moe_experts)
    load_hf_weights(chunks, hf_dir)
    return chunks


def _experts_module(chunks):
    return chunks[0].decoder.layers[0].mlp.experts


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_student_gives_hf_logits_and_exports_the_checkpoint(one_rank, ckpts, family):

    chunks = _student(ckpts[family], "torch_grouped")
    assert isinstance(_experts_module(chunks), TorchGroupedMLP)
    vocab = chunks[0].opkd_layout.vocab_size
    tokens = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    chunks[0].eval()
    with torch.no_grad():
        logits = pipeline_logits(chunks, tokens)[..., :vocab]
    torch.testing.assert_close(logits, hf_logits(ckpts[family], tokens), rtol=1e-4, atol=2e-5)
    assert _export_mismatches(chunks, ckpts[family]) == []  # every HF tensor, bit for bit


def test_dist_checkpoint_moves_between_sequential_and_grouped(one_rank, ckpts, tmp_path):
    """A checkpoint of grouped experts loads into SequentialMLP (same keys, same tensors) and back."""
    hf_dir = ckpts["qwen2_moe"]
    grouped = _student(hf_dir, "torch_grouped")
    with torch.no_grad():  # weights that differ from the HF ones, so a load that does nothing fails
        for p in grouped[0].parameters():
            p.add_(0.25 * torch.randn_like(p))
    save_mcore_checkpoint(grouped, str(tmp_path / "g"))
    sequential = _student(hf_dir, "sequential")
    load_mcore_model(sequential, str(tmp_path / "g"))
    g_exp, s_exp = _experts_module(grouped), _experts_module(sequential)
    for i, expert in enumerate(s_exp.local_experts):
        assert torch.equal(expert.linear_fc1.weight, g_exp.fc1_weight[i])
        assert torch.equal(expert.linear_fc2.weight, g_exp.fc2_weight[i])
    save_mcore_checkpoint(sequential, str(tmp_path / "s"))
    again = _student(hf_dir, "torch_grouped")
    load_mcore_model(again, str(tmp_path / "s"))
    for a, b in zip(again[0].state_dict().values(), grouped[0].state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
