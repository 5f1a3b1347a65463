"""MoE bridges without processes: config mapping, refusals naming the key, expert ownership, config
validation of `parallel.ep` / `loss.moe_aux_loss_coef` for MoE and dense students."""
from __future__ import annotations

import json

import pytest
import yaml

from opkd_mcore.models.bridge import get_bridge
from opkd_mcore.models.tiny import TinyModelShape, tiny_hf_config


def _config(family: str, **extra):
    return tiny_hf_config(family, TinyModelShape(num_layers=2, extra=extra))


@pytest.mark.parametrize("family,extra,pre_softmax", [
    ("qwen3_moe", dict(norm_topk_prob=True), False),   # softmax over the top-k logits = renormalised
    ("qwen3_moe", dict(norm_topk_prob=False), True),   # softmax over all experts, raw top-k weights
    ("qwen2_moe", dict(), True),                       # Qwen2-MoE: norm_topk_prob False by default
    ("mixtral", dict(), False),                        # Mixtral always renormalises
])
def test_router_mapping_follows_norm_topk_prob(family, extra, pre_softmax):
    kwargs = get_bridge(_config(family, **extra)).transformer_config_kwargs()
    assert kwargs["moe_router_pre_softmax"] is pre_softmax
    assert kwargs["num_moe_experts"] == 8 and kwargs["moe_router_topk"] == 2
    assert kwargs["moe_router_load_balancing_type"] == "none" and kwargs["moe_aux_loss_coeff"] == 0.0
    assert kwargs["moe_grouped_gemm"] is False and kwargs["moe_token_dispatcher_type"] == "alltoall"
    assert kwargs["moe_expert_capacity_factor"] is None and not kwargs["moe_pad_expert_input_to_capacity"]


def test_qwen2_moe_maps_its_gated_shared_expert():
    bridge = get_bridge(_config("qwen2_moe"))
    kwargs = bridge.transformer_config_kwargs()
    assert kwargs["moe_shared_expert_intermediate_size"] == 128 and kwargs["moe_shared_expert_gate"] is True
    assert kwargs["add_qkv_bias"] is True
    names = [n for n, _ in bridge.hf_layer_shapes(0)]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    assert names.count("model.layers.0.mlp.gate.weight") == 1


def test_mixtral_names_and_expert_of():
    bridge = get_bridge(_config("mixtral"))
    shapes = dict(bridge.hf_layer_shapes(1))
    assert shapes["model.layers.1.block_sparse_moe.experts.7.w1.weight"] == (256, 128)
    assert shapes["model.layers.1.block_sparse_moe.experts.7.w2.weight"] == (128, 256)
    assert "model.layers.1.mlp.gate_proj.weight" not in shapes
    assert bridge.expert_of("model.layers.1.block_sparse_moe.experts.7.w3.weight") == 7
    assert bridge.expert_of("model.layers.1.block_sparse_moe.gate.weight") is None


def test_unsupported_moe_architecture_is_named():
    cfg = _config("qwen3_moe")
    cfg.architectures = ["OlmoeForCausalLM"]
    with pytest.raises(ValueError) as err:
        get_bridge(cfg)
    msg = str(err.value)
    assert "mixture-of-experts architecture 'OlmoeForCausalLM'" in msg and "Qwen3MoeForCausalLM" in msg


@pytest.mark.parametrize("extra,key", [
    (dict(mlp_only_layers=[1]), "decoder_sparse_step/mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step/mlp_only_layers"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_unsupported_moe_configs_name_the_key(extra, key):
    with pytest.raises(ValueError, match=f"^{key}"):
        get_bridge(_config("qwen3_moe", **extra))


@pytest.mark.parametrize("args,message", [
    (dict(tp=1, pp=1, vpp=None, ep=3), "ep: 3 does not divide the model's 8 experts (num_experts)"),
    (dict(tp=1, pp=1, vpp=None, ep=2, etp=3),
     "etp: expert tensor-parallel size 3 does not divide moe_intermediate_size=64"),
])
def test_parallel_layout_that_does_not_fit_the_experts(args, message):
    with pytest.raises(ValueError) as err:
        get_bridge(_config("qwen3_moe")).check_parallel(**args)
    assert str(err.value) == message


def test_dense_bridge_accepts_expert_parallel_groups():
    # a dense teacher shares an MoE student's EP groups: it has no experts to split
    get_bridge(_config("qwen3")).check_parallel(1, 1, None, ep=2)


# ----------------------------------------------------------------------------- run config
def _hf_dir(tmp_path, name, **extra):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=64,
        architectures=["Qwen3MoeForCausalLM" if extra else "Qwen3ForCausalLM"], **extra)))
    return str(d)


@pytest.fixture
def moe_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = {
        "model": {"student": _hf_dir(tmp_path, "student", num_experts=8)},
        "parallel": {"ep": 2, "world_size": 2, "micro_batch_size": 2, "global_batch_size": 8},
        "loss": {"support": "teacher", "moe_aux_loss_coef": 0.01},
        "rollout": {"prompts_per_step": 4, "n": 2},
        "teacher": {"teachers": [{"backend": "vllm", "model": _hf_dir(tmp_path, "teacher"), "top_k": 8}]},
        "run": {"output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), tmp_path


def test_moe_student_at_ep2_validates(moe_run):
    from opkd_mcore.config import load_config

    cfg = load_config(moe_run[0])
    assert cfg.parallel.ep == 2 and cfg.loss.moe_aux_loss_coef == pytest.approx(0.01)


@pytest.mark.parametrize("overrides,key,fragment", [
    (["parallel.ep=3", "parallel.world_size=3"], "parallel.ep", "does not divide the student's 8 experts"),
    (["parallel.tp=2"], "parallel.tp", "MoE student trains at tp=1"),
    (["parallel.world_size=3"], "parallel.ep", "etp*ep*pp = 2 does not divide the world size 3"),
    (["loss.moe_aux_loss_coef=-0.1"], "loss.moe_aux_loss_coef", ">= 0"),
    (["model.moe_experts=grouped"], "model.moe_experts", "torch_grouped"),
    (["teacher.teachers.0.backend=megatron", "teacher.teachers.0.model={moe8}", "parallel.ep=2",
      "loss.support=null"], None, None),
])
def test_moe_run_config_rejections(moe_run, overrides, key, fragment):
    from opkd_mcore.config import ConfigError, load_config

    path, root = moe_run
    moe8 = _hf_dir(root, "teacher_moe", num_experts=6)  # 6 experts: EP=2 divides, EP=4 would not
    overrides = [o.replace("{moe8}", moe8) for o in overrides]
    if key is None:  # an MoE megatron teacher on the student's EP groups is accepted
        assert load_config(path, overrides).teacher.teachers[0].backend == "megatron"
        with pytest.raises(ConfigError, match="^parallel.ep: 4 does not divide the 6 experts of the megatron"):
            load_config(path, overrides[:-2] + ["parallel.ep=4", "parallel.world_size=4", "loss.support=null"])
        return
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert str(err.value).startswith(key) and fragment in str(err.value), str(err.value)


def test_dense_student_rejects_moe_options(moe_run):
    from opkd_mcore.config import ConfigError, load_config

    path, root = moe_run
    dense = _hf_dir(root, "dense")
    with pytest.raises(ConfigError, match="^parallel.ep: expected 1"):
        load_config(path, [f"model.student={dense}", "loss.moe_aux_loss_coef=0"])
    with pytest.raises(ConfigError, match="^loss.moe_aux_loss_coef: 0.01 needs an MoE student"):
        load_config(path, [f"model.student={dense}", "parallel.ep=1"])
