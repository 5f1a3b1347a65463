"""Megatron GPTModel built from HF checkpoints == the HF model (logits, exported tensors).

Every family (Llama 3.x with llama3 RoPE scaling, Qwen2 with qkv bias + tied embeddings + padded
vocab, Qwen3 with q/k norm, Mistral) at TP=1 (DP=2), TP=2 and PP=2, plus Qwen3 with PP=2 x VPP=2.
All cases run in ONE pair of real processes over gloo (spawning is the expensive part on CPU);
each test then checks its case against an independent reference: the HF `transformers` forward
(fp32, eager attention) and the original checkpoint bytes.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests._dist import run_distributed

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
LAYOUTS = {"tp1": dict(tp=1), "tp2": dict(tp=2), "pp2": dict(pp=2), "pp2vpp2": dict(pp=2, vpp=2)}
CASES = [(f, lay) for f in FAMILIES for lay in ("tp1", "tp2", "pp2")] + [("qwen3", "pp2vpp2")]
SEQ_LEN, BATCH = 11, 2
PACKED_LENGTHS = (5, 9, 3)  # sequences packed back to back for the thd (packed) attention path


def _shape(family: str):
    from opkd_mcore.models.tiny import TinyModelShape

    extra = {}
    if family == "llama":
        extra["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 500000.0}
    # qwen2: a vocabulary TP=2 x 64 does not divide, so the padding path is exercised
    return TinyModelShape(vocab_size=250 if family == "qwen2" else 256, num_layers=4,
                          num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=family == "qwen2", extra=extra)


def _tokens(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=g)


# ----------------------------------------------------------------------------- worker side
def _gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    size = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def pipeline_logits(chunks, tokens, packed_seq_params=None):
    """Forward through all PP stages / VPP chunks by hand (p2p over the PP group).

    Returns full-vocab logits [b, s, V] on the last stage, None elsewhere.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from opkd_mcore.models import layout_of

    layout = layout_of(chunks)
    pp, stage = layout.pp, layout.pp_rank
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    hidden_shape = (tokens.shape[1], tokens.shape[0], layout.bridge.hf_config.hidden_size)
    steps = [(v, s) for v in range(len(chunks)) for s in range(pp)]
    out = None
    for i, (v, s) in enumerate(steps):
        if s != stage:
            continue
        model = chunks[v]
        if i > 0:
            recv = torch.empty(hidden_shape)
            dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(recv)
        out = model(input_ids=tokens, position_ids=position_ids, attention_mask=None,
                    packed_seq_params=packed_seq_params)
        if i < len(steps) - 1:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if stage != pp - 1:
        return None
    return _gather_vocab(out, layout.vocab_size)


def _packed_logits(chunks, vocab: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, *torch.cumsum(torch.tensor(PACKED_LENGTHS), 0).tolist()],
                          dtype=torch.int32)
    tokens = torch.randint(0, vocab, (1, int(bounds[-1])), generator=torch.Generator().manual_seed(3))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(PACKED_LENGTHS), max_seqlen_kv=max(PACKED_LENGTHS))
    return tokens, pipeline_logits(chunks, tokens, params)


def _export_mismatches(chunks, hf_dir: str) -> list[str]:
    """Names whose exported tensor differs (bitwise) from the original checkpoint."""
    from safetensors import safe_open

    from opkd_mcore.models import iter_hf_weights

    bad = []
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        seen = []
        for name, tensor in iter_hf_weights(chunks, stages="all"):
            seen.append(name)
            if name not in keys or not torch.equal(f.get_tensor(name), tensor):
                bad.append(name)
        tied_extra = {"lm_head.weight"} if "lm_head.weight" in keys and "lm_head.weight" not in seen \
            else set()
        bad += sorted(keys - set(seen) - tied_extra)
    return bad


def _view_mismatches(chunks, hf_dir: str) -> list[str]:
    """Names whose tensor in the weight-sync export (`views=True`: views of the parameters or of one
    gather, in a shape refining the HF one) is not the original checkpoint's, or not in such a shape."""
    from safetensors import safe_open

    from opkd_mcore.models import iter_hf_weights
    from opkd_mcore.weight_sync.sender import refines

    bad = []
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for name, view in iter_hf_weights(chunks, stages="local", views=True):
            want = f.get_tensor(name) if name in keys else None
            if want is None or not refines(tuple(view.shape), tuple(want.shape)) or \
                    not torch.equal(want, view.reshape(want.shape)):
                bad.append(name)
    return bad


def _run_case(rank, family, layout_name, hf_dir, out_root):
    from opkd_mcore.models import (
        build_model,
        hf_weight_metadata,
        iter_hf_weights,
        load_hf_config,
        load_hf_weights,
        save_hf_checkpoint,
    )
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(**LAYOUTS[layout_name]))
    try:
        cfg = load_hf_config(hf_dir)
        chunks = build_model(cfg, make_vocab_size_divisible_by=64)
        load_hf_weights(chunks, hf_dir)
        with torch.no_grad():
            logits = pipeline_logits(chunks, _tokens(cfg.vocab_size))
            packed = _packed_logits(chunks, cfg.vocab_size) if layout_name == "tp2" else None
        meta = hf_weight_metadata(chunks)
        local = [(n, tuple(t.shape), t.dtype) for n, t in iter_hf_weights(chunks, stages="local")]
        # numpy, not torch: tensors would travel as shared memory of a process about to exit
        result = dict(logits=_np(logits), packed=packed and tuple(_np(t) for t in packed),
                      meta=meta, local=local,
                      mismatches=_export_mismatches(chunks, hf_dir),
                      view_mismatches=_view_mismatches(chunks, hf_dir),
                      pp_rank=chunks[0].opkd_layout.pp_rank,
                      padded_vocab=chunks[0].opkd_layout.padded_vocab_size)
        if layout_name != "tp1" and family == "qwen3":
            save_hf_checkpoint(chunks, os.path.join(out_root, f"{family}_{layout_name}"),
                               src_hf_dir=hf_dir, max_shard_bytes=300_000, progress=False)
        return result
    finally:
        destroy_parallel()


def _np(t):
    return None if t is None else t.numpy()


def run_cases(rank, world_size, ckpts, out_root):
    return {(f, lay): _run_case(rank, f, lay, ckpts[f], out_root) for f, lay in CASES}


# ----------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from opkd_mcore.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    return {f: save_tiny_hf_model(str(root / f), f, _shape(f), seed=11) for f in FAMILIES}


@pytest.fixture(scope="module")
def results(ckpts, tmp_path_factory):
    out_root = str(tmp_path_factory.mktemp("export"))
    per_rank = run_distributed(run_cases, 2, ckpts, out_root)
    return per_rank, out_root


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _last_stage(per_rank, case):
    return [r[case] for r in per_rank if r[case]["logits"] is not None]


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_logits_match_hf(results, ckpts, case):
    per_rank, _ = results
    family = case[0]
    from opkd_mcore.models import load_hf_config

    vocab = load_hf_config(ckpts[family]).vocab_size
    expected = hf_logits(ckpts[family], _tokens(vocab))
    outs = _last_stage(per_rank, case)
    assert outs, "no rank returned logits"
    for out in outs:
        logits = torch.from_numpy(out["logits"])
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_match_separate_hf_forwards(results, ckpts, family):
    per_rank, _ = results
    tokens, logits = map(torch.from_numpy, per_rank[0][(family, "tp2")]["packed"])
    start = 0
    for length in PACKED_LENGTHS:
        seq = tokens[:, start:start + length]
        torch.testing.assert_close(logits[:, start:start + length], hf_logits(ckpts[family], seq),
                                   rtol=1e-4, atol=2e-5)
        start += length


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_export_reproduces_checkpoint_bit_for_bit(results, case):
    per_rank, _ = results
    for r in per_rank:
        assert r[case]["mismatches"] == []
        assert r[case]["view_mismatches"] == []


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_metadata_same_on_all_ranks_and_matches_local_stream(results, case):
    per_rank, _ = results
    metas = [r[case]["meta"] for r in per_rank]
    assert metas[0] == metas[1]
    for r in per_rank:
        expected = [(m.hf_name, tuple(m.shape), m.dtype) for m in r[case]["meta"]
                    if m.pp_stage == r[case]["pp_rank"]]
        assert r[case]["local"] == expected
    stages = [m.pp_stage for m in metas[0]]
    if case[1] == "pp2":  # embedding on the first stage, final norm / head on the last, in order
        assert stages[0] == 0 and stages[-1] == 1 and stages == sorted(stages)


def test_vpp_interleaves_layers_over_stages(results):
    per_rank, _ = results
    meta = per_rank[0][("qwen3", "pp2vpp2")]["meta"]
    stage_of_layer = {int(m.hf_name.split(".")[2]): m.pp_stage for m in meta
                      if m.hf_name.startswith("model.layers.")}
    assert stage_of_layer == {0: 0, 1: 1, 2: 0, 3: 1}  # 4 layers, 2 stages x 2 chunks of 1 layer


def test_vocab_padding_is_removed_on_export(results):
    per_rank, _ = results
    case = per_rank[0][("qwen2", "tp2")]
    assert case["padded_vocab"] == 256
    embed = [m for m in case["meta"] if m.hf_name == "model.embed_tokens.weight"][0]
    assert embed.shape == (250, 128)


@pytest.mark.parametrize("layout_name", ["tp2", "pp2", "pp2vpp2"])
def test_saved_checkpoint_loads_in_transformers_bit_for_bit(results, ckpts, layout_name):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out_root = results
    out = os.path.join(out_root, f"qwen3_{layout_name}")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1  # really sharded
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    with safe_open(os.path.join(ckpts["qwen3"], "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(weight_map)
        for name in f.keys():
            assert torch.equal(state[name], f.get_tensor(name)), name
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("12+3=")["input_ids"]  # the saved tokenizer still adds the BOS the model was trained with
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "12+3="
