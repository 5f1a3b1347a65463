"""Bad input to the model builder/loader fails early with a message naming what is wrong."""
from __future__ import annotations

import json
import os

import pytest
import torch

from opkd_mcore.models import get_bridge, load_hf_config, padded_vocab_size
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model, tiny_hf_config


def _config(family="qwen3", **extra):
    return tiny_hf_config(family, TinyModelShape(num_attention_heads=4, num_key_value_heads=2,
                                                 extra=extra))


def test_unsupported_architecture_is_named():
    cfg = _config()
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="architectures: 'GPT2LMHeadModel' is not supported; "
                                         "supported: .*Qwen3ForCausalLM"):
        get_bridge(cfg)


def test_config_without_architecture():
    cfg = _config()
    cfg.architectures = None
    with pytest.raises(ValueError, match="lists no architecture"):
        get_bridge(cfg)


@pytest.mark.parametrize("family, arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                          ("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_each_family_has_a_bridge_with_its_features(family, arch):
    bridge = get_bridge(_config(family))
    assert arch in bridge.architectures
    assert bridge.qkv_bias == (family == "qwen2")
    assert bridge.qk_norm == (family == "qwen3")
    kwargs = bridge.transformer_config_kwargs()
    assert kwargs["num_query_groups"] == 2 and kwargs["kv_channels"] == 64
    assert kwargs["gated_linear_unit"] and kwargs["normalization"] == "RMSNorm"


def test_non_silu_activation_is_rejected():
    with pytest.raises(ValueError, match="hidden_act: .* got 'gelu'"):
        get_bridge(_config(hidden_act="gelu"))


@pytest.mark.parametrize("key", ["attention_bias", "mlp_bias"])
def test_biases_without_a_mapping_are_rejected(key):
    with pytest.raises(ValueError, match=f"{key}: True is not supported by the llama bridge"):
        get_bridge(_config("llama", **{key: True}))


def test_unsupported_rope_scaling_is_rejected():
    cfg = _config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                            "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="rope_type: expected one of .* got 'yarn'"):
        get_bridge(cfg)


@pytest.mark.parametrize("tp, pp, vpp, match", [
    (4, 1, None, "tp: 4 does not divide num_key_value_heads=2"),
    (3, 1, None, "tp: 3 does not divide num_attention_heads=4"),
    (1, 2, 2, "num_hidden_layers=2 is not divisible by pp\\*vpp = 2\\*2"),
])
def test_parallel_layout_that_does_not_fit_the_model(tp, pp, vpp, match):
    with pytest.raises(ValueError, match=match):
        get_bridge(_config()).check_parallel(tp, pp, vpp)


def test_missing_checkpoint_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="hf_dir: no config.json"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="has no 'model_type'"):
        load_hf_config(str(tmp_path))


def test_padded_vocab_size():
    assert padded_vocab_size(250, tp=2) == 250
    assert padded_vocab_size(251, tp=2) == 252
    assert padded_vocab_size(250, tp=2, divisible_by=64) == 256
    assert padded_vocab_size(151936, tp=8) == 151936
    assert padded_vocab_size(151936, tp=8, divisible_by=128) == 152576  # Megatron: multiple of 128*tp


@pytest.fixture
def one_rank_parallel():
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig())
    yield
    destroy_parallel(destroy_process_group=True)


def test_loader_names_missing_tensor_and_shape_mismatch(tmp_path, one_rank_parallel):
    from safetensors.torch import load_file, save_file

    from opkd_mcore.models import build_model, load_hf_weights

    src = save_tiny_hf_model(str(tmp_path / "ok"), "qwen3",
                             TinyModelShape(num_attention_heads=4, num_key_value_heads=2))
    chunks = build_model(load_hf_config(src))
    load_hf_weights(chunks, src)  # the good checkpoint loads
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor"):
        load_hf_weights(chunks, str(tmp_path))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    name = "model.layers.1.self_attn.k_norm.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, os.path.join(src, "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(KeyError, match=name):
        load_hf_weights(chunks, src)
    tensors[name] = torch.ones(32)
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="give a shard of shape \\(32,\\) but the Megatron parameter "
                                         "has shape \\(64,\\)"):
        load_hf_weights(chunks, src)
