"""GPU lane: the grouped experts (Transformer Engine's `TEGroupedMLP`, `TorchGroupedMLP`) against
Megatron's `SequentialMLP` and the HF model, at EP=1 on one GPU in bf16.

One tiny Qwen3-MoE checkpoint is loaded into a student of each experts implementation. Logits: each
within the bf16 rounding of HF's fp32 forward (as tests/test_models_gpu.py judges bf16). Gradients
of one cross-entropy backward: every expert's fc1/fc2 gradient of a grouped module against
`SequentialMLP`'s (same weights, same routing), relative to its norm. The export of each is the
checkpoint bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.models.builder import transformer_engine_usable
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import run_distributed
from tests.test_models_gpu import NCCL_ENV

pytestmark = pytest.mark.gpu
SEQ_LEN, BATCH = 64, 2
IMPLS = ("sequential", "torch_grouped", "te_grouped")


def _expert_grads(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2F, H] and [E, H, F] gradients of the local experts, whatever the module's layout."""
    name = type(experts).__name__
    if name == "TorchGroupedMLP":
        return experts.fc1_weight.grad, experts.fc2_weight.grad
    if name == "SequentialMLP":
        return (torch.stack([e.linear_fc1.weight.grad for e in experts.local_experts]),
                torch.stack([e.linear_fc2.weight.grad for e in experts.local_experts]))
    n = experts.num_local_experts  # TEGroupedMLP: weight{i} per expert
    return (torch.stack([getattr(experts.linear_fc1, f"weight{i}").grad for i in range(n)]),
            torch.stack([getattr(experts.linear_fc2, f"weight{i}").grad for i in range(n)]))


def _worker(rank, world_size, hf_dir, impls):
    from megatron.core import tensor_parallel
    from safetensors import safe_open

    from opkd_mcore.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(seed=1))
    out = {}
    try:
        cfg = load_hf_config(hf_dir)
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(5)).cuda()
        pos = torch.arange(SEQ_LEN, device="cuda").unsqueeze(0).expand(BATCH, -1)
        for impl in impls:
            chunks = build_model(cfg, moe_experts=impl)  # bf16
            load_hf_weights(chunks, hf_dir)
            # [b, s, V] (TP 1: the whole vocabulary)
            logits = chunks[0](input_ids=tokens[:, :-1], position_ids=pos, attention_mask=None)
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tokens[:, 1:]).mean()
            loss.backward()
            bad = []
            with safe_open(f"{hf_dir}/model.safetensors", framework="pt") as f:
                for name, tensor in iter_hf_weights(chunks, stages="all"):
                    if not torch.equal(tensor.cpu(), f.get_tensor(name).to(torch.bfloat16)):
                        bad.append(name)
            grads = [tuple(g.detach().float().cpu().numpy() for g in _expert_grads(layer.mlp.experts))
                     for layer in chunks[0].decoder.layers]
            out[impl] = dict(logits=logits[..., :cfg.vocab_size].detach().float().cpu().numpy(), bad=bad, grads=grads,
                             module=type(chunks[0].decoder.layers[0].mlp.experts).__name__,
                             fusions=(chunks[0].config.moe_permute_fusion, chunks[0].config.moe_router_fusion))
            del chunks, logits, loss
        return out
    finally:
        destroy_parallel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", IMPLS[1:])
def test_grouped_experts_match_sequential_and_hf(tmp_path, impl, record_property):
    from transformers import AutoModelForCausalLM

    if impl == "te_grouped" and not transformer_engine_usable():
        pytest.skip("needs Transformer Engine")
    shape = TinyModelShape(hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, vocab_size=512, extra=dict(moe_intermediate_size=128))
    hf_dir = save_tiny_hf_model(str(tmp_path / "qwen3_moe"), "qwen3_moe", shape, seed=3, init_std=0.1)
    tokens = torch.randint(0, 512, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(5))
    ref = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).cuda().eval()
        with torch.no_grad():
            ref[dtype] = model(input_ids=tokens[:, :-1].cuda()).logits.float().cpu()
    (res,) = run_distributed(_worker, 1, hf_dir, ("sequential", impl), backend=None, env=NCCL_ENV)
    assert res[impl]["module"] == {"torch_grouped": "TorchGroupedMLP", "te_grouped": "TEGroupedMLP"}[impl]
    # with TE every module runs behind Megatron's fused permutation and router (models.builder.kernel_fusions)
    te = transformer_engine_usable()
    assert res["sequential"]["fusions"] == res[impl]["fusions"] == (te, te)
    err_hf_bf16 = (ref[torch.bfloat16] - ref[torch.float32]).abs().max().item()
    for name in ("sequential", impl):
        assert res[name]["bad"] == []
        err = (torch.from_numpy(res[name]["logits"]) - ref[torch.float32]).abs().max().item()
        record_property(f"max_abs_err_{name}", err)
        assert err <= 3.0 * err_hf_bf16 + 1e-3, (name, err, err_hf_bf16)
    for layer_seq, layer_grp in zip(res["sequential"]["grads"], res[impl]["grads"]):
        for g_seq, g_grp in zip(layer_seq, layer_grp):
            g_seq, g_grp = torch.from_numpy(g_seq), torch.from_numpy(g_grp)
            rel = ((g_grp - g_seq).norm() / g_seq.norm()).item()
            record_property(f"grad_rel_err_{impl}", rel)
            # same bf16 inputs, same routing: the GEMMs differ only in accumulation order
            assert g_seq.norm() > 0 and rel < 2e-2, rel


def _sync_free_worker(rank, world_size):
    """`TorchGroupedMLP`'s forward with the counts on the host, as Megatron's dispatchers hand them:
    under CUDA's sync debug mode set to error, then against the same call with the counts on the device."""
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from opkd_mcore.models.grouped_experts import TorchGroupedMLP
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(seed=1))
    try:
        config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, ffn_hidden_size=64,
                                   moe_ffn_hidden_size=64, num_moe_experts=4, gated_linear_unit=True,
                                   activation_func=F.silu, add_bias_linear=False, moe_router_topk=2,
                                   params_dtype=torch.bfloat16, bf16=True)
        experts = TorchGroupedMLP(4, config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        gen = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        probs = torch.rand(128, device="cuda", generator=gen)
        counts = torch.tensor([40, 0, 56, 32]).pin_memory()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                out, _ = experts(x, counts, probs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with torch.no_grad():
            ref, _ = experts(x, counts.cuda(), probs)
        return torch.equal(out, ref), out.abs().sum().item()
    finally:
        destroy_parallel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_grouped_experts_never_wait_for_the_device():
    """A blocking copy of the counts to the device would make the host wait for the device to drain
    at every MoE layer of every micro-batch."""
    ((same, total),) = run_distributed(_sync_free_worker, 1, backend=None, env=NCCL_ENV)
    assert same and total > 0
