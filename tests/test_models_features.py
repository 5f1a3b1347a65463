"""Model options the trainer uses, in one process (TP=1): activation recompute, bf16 params,
and options that cannot work with the local layer spec fail with a clear error."""
from __future__ import annotations

import os

import pytest
import torch

from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    shape = TinyModelShape(num_attention_heads=4, num_key_value_heads=2)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("hf") / "qwen3"), "qwen3", shape, seed=5)


@pytest.fixture(scope="module")
def one_rank():
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig())
    yield
    destroy_parallel(destroy_process_group=True)


def _grads(hf_dir, **overrides):
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights

    model = build_model(load_hf_config(hf_dir), **overrides)[0]
    load_hf_weights([model], hf_dir)
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10).unsqueeze(0).expand_as(tokens)
    model(input_ids=tokens, position_ids=pos, attention_mask=None).float().pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_full_activation_recompute_gives_the_same_gradients(qwen3_dir, one_rank):
    plain = _grads(qwen3_dir)
    recomputed = _grads(qwen3_dir, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
    assert plain.keys() == recomputed.keys()
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0)


def test_bf16_params_load_and_export_bf16(qwen3_dir, one_rank):
    from safetensors import safe_open

    from opkd_mcore.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights

    chunks = build_model(load_hf_config(qwen3_dir), params_dtype=torch.bfloat16)
    assert {p.dtype for p in chunks[0].parameters()} == {torch.bfloat16}  # norms included
    load_hf_weights(chunks, qwen3_dir)
    with safe_open(f"{qwen3_dir}/model.safetensors", framework="pt") as f:
        for name, tensor in iter_hf_weights(chunks):
            assert torch.equal(tensor, f.get_tensor(name).to(torch.bfloat16)), name


def test_sequence_parallel_needs_transformer_engine(qwen3_dir, one_rank):
    from opkd_mcore.models import build_model, load_hf_config

    with pytest.raises(ValueError, match="sequence_parallel: needs the Transformer Engine"):
        build_model(load_hf_config(qwen3_dir), use_te=False, sequence_parallel=True)


def test_loads_sharded_hf_checkpoint(qwen3_dir, one_rank, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from opkd_mcore.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights

    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="200KB")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    chunks = build_model(load_hf_config(sharded))
    load_hf_weights(chunks, sharded)
    with safe_open(f"{qwen3_dir}/model.safetensors", framework="pt") as f:
        exported = dict(iter_hf_weights(chunks))
        assert exported.keys() == set(f.keys())
        for name, tensor in exported.items():
            assert torch.equal(tensor, f.get_tensor(name)), name


def test_kernel_fusions_follow_the_layer_spec(qwen3_dir, one_rank):
    """Megatron's fused SwiGLU and RoPE are on exactly where the TE spec builds the model (its RoPE
    kernel is TE's, so a CPU config cannot even hold it); the local spec keeps the unfused paths."""
    from opkd_mcore.models import build_model, load_hf_config
    from opkd_mcore.models.bridge import get_bridge
    from opkd_mcore.models.builder import kernel_fusions, transformer_config

    assert kernel_fusions(True) == dict(bias_activation_fusion=True, apply_rope_fusion=True)
    assert kernel_fusions(False) == dict(bias_activation_fusion=False, apply_rope_fusion=False)
    # an MoE model's fused permutation and router follow the same spec
    assert kernel_fusions(True, moe=True) == dict(bias_activation_fusion=True, apply_rope_fusion=True,
                                                  moe_permute_fusion=True, moe_router_fusion=True)
    assert not any(kernel_fusions(False, moe=True).values())
    config = build_model(load_hf_config(qwen3_dir))[0].config  # CPU: the local spec
    assert (config.bias_activation_fusion, config.apply_rope_fusion) == (False, False)
    # the TE build's config takes them; an explicit override still wins (the benchmark's A/B, and
    # Megatron refuses the fused RoPE where TE is not installed)
    te = transformer_config(get_bridge(load_hf_config(qwen3_dir)), torch.float32, use_te=True,
                            apply_rope_fusion=False)
    assert (te.bias_activation_fusion, te.apply_rope_fusion) == (True, False)
