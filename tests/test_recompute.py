"""`parallel.recompute` on a real Megatron student step (one process, CPU, float32): selective and full
recompute give the same loss and gradients as none, and they really run the recomputed part again in
backward (the core attention twice per layer and micro-batch, the local SDPA attention included)."""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.engine.packing import pack_sequences
from opkd_mcore.models.builder import memory_overrides
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import run_distributed

megatron = pytest.importorskip("megatron.core")

SEQUENCES = [[1, 4, 5, 14, 6, 15, 9, 2], [1, 7, 8, 14, 9, 15, 10, 11, 2], [1, 3, 3, 14, 12, 15, 13, 2]]
PROMPT_LENGTHS = [4, 4, 3]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    shape = TinyModelShape(num_attention_heads=4, num_key_value_heads=2)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("hf") / "qwen3"), "qwen3", shape, seed=5)


def _ce_loss_fn(num_tokens: int):
    from megatron.core import tensor_parallel

    def loss_fn(logits, batch):
        targets = torch.roll(batch.tokens, -1)
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float().unsqueeze(1),
                                                                 targets.unsqueeze(1)).squeeze(1)
        return (per_token * batch.loss_mask).sum() / num_tokens, {}
    return loss_fn


def _step(rank, world, hf_dir, modes):
    """Per mode: (loss, {param: gradient}, core-attention forward calls) of one train step."""
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(seed=7))
    results = {}
    try:
        for mode in modes:
            chunks = build_model(load_hf_config(hf_dir), **memory_overrides(mode))
            load_hf_weights(chunks, hf_dir)
            calls = []
            for layer in chunks[0].decoder.layers:
                layer.self_attention.core_attention.register_forward_hook(lambda *a: calls.append(1))
            engine = MegatronEngine(chunks, OptimSection(lr=1e-3, clip_grad=0.0))
            batches = [pack_sequences(SEQUENCES[:2], PROMPT_LENGTHS[:2]),
                       pack_sequences(SEQUENCES[2:], PROMPT_LENGTHS[2:])]
            loss_fn = _ce_loss_fn(sum(b.num_loss_tokens for b in batches))
            metrics = engine.train_step(batches, loss_fn)
            grads = {n: p.main_grad.detach().clone() for n, p in engine.model[0].named_parameters()}
            results[mode] = (metrics["train/loss"], grads, len(calls), len(chunks[0].decoder.layers))
    finally:
        destroy_parallel()
    return results


def test_recompute_modes_give_the_loss_and_gradients_of_none_and_recompute(qwen3_dir):
    (results,) = run_distributed(_step, 1, qwen3_dir, ["none", "selective", "full"])
    loss, grads, calls, layers = results["none"]
    assert calls == 2 * layers  # two micro-batches, one forward each
    assert sum(g.abs().sum() for g in grads.values()) > 0
    for mode in ("selective", "full"):
        other_loss, other_grads, other_calls, _ = results[mode]
        assert other_calls == 2 * calls, mode  # run again in backward: not a silent no-op
        assert other_loss == loss, mode
        assert other_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{mode}: {name}")


def test_memory_overrides_map_each_mode_once():
    assert memory_overrides() == {}
    assert memory_overrides("selective") == {"recompute_granularity": "selective",
                                             "recompute_modules": ["core_attn"]}
    assert memory_overrides("full", sequence_parallel=True) == {
        "sequence_parallel": True, "recompute_granularity": "full", "recompute_method": "uniform",
        "recompute_num_layers": 1}
    with pytest.raises(ValueError, match="recompute: expected one of"):
        memory_overrides("block")
