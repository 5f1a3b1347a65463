"""MoE checkpoints through `tools/convert_ckpt.py`: HF -> Megatron(EP=2) -> HF, bit for bit.

A tiny Qwen2-MoE (8 experts, top-2, shared expert + its gate, q/k/v biases, tied embeddings) in
bf16, sharded on disk. `hf-to-mcore --ep 2` spawns two ranks, each reading only its four experts;
`mcore-to-hf` loads the global expert tensors back with one rank (EP=1) and, separately, with the
EP=2 layout, so both directions cross layouts. The reference is the original checkpoint's bytes.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.test_convert import _read_safetensors, _run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def src_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    out = str(tmp_path_factory.mktemp("src_moe"))
    shape = TinyModelShape(vocab_size=251, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)
    save_tiny_hf_model(out, "qwen2_moe", shape, seed=13, init_std=0.05)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(out, name))
    model.save_pretrained(out, max_shard_size="300KB")
    return out


@pytest.fixture(scope="module")
def converted(src_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_moe")
    mcore, back1, back2 = str(root / "mcore"), str(root / "hf_ep1"), str(root / "hf_ep2")
    for args in (("hf-to-mcore", "--hf-dir", src_dir, "--out", mcore, "--ep", "2"),
                 ("mcore-to-hf", "--mcore-dir", mcore, "--out", back1, "--max-shard-size", "400KB"),
                 ("mcore-to-hf", "--mcore-dir", mcore, "--out", back2, "--ep", "2")):
        done = _run_script(*args)
        assert done.returncode == 0, done.stderr[-4000:]
    return mcore, back1, back2


@pytest.mark.parametrize("which", [1, 2], ids=["back-ep1", "back-ep2"])
def test_round_trip_through_ep2_is_bit_exact(src_dir, converted, which):
    original, back = _read_safetensors(src_dir), _read_safetensors(converted[which])
    assert sorted(back) == sorted(original)
    assert any(".experts.7.down_proj" in n for n in back) and "model.layers.1.mlp.shared_expert_gate.weight" in back
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(back[name].view(torch.int16), tensor.view(torch.int16)), name


def test_checkpoint_records_the_expert_layout(converted):
    with open(os.path.join(converted[0], "opkd_checkpoint.json")) as f:
        meta = json.load(f)
    assert meta["architecture"] == "Qwen2MoeForCausalLM"
    assert meta["saved_with"] == {"tp": 1, "pp": 1, "vpp": None, "ep": 2, "etp": 1}


def test_ep_not_dividing_experts_is_refused(src_dir, tmp_path, capsys):
    from opkd_mcore.models.convert import main as convert_main

    assert convert_main(["hf-to-mcore", "--hf-dir", src_dir, "--out", str(tmp_path / "o"), "--ep", "3"]) == 2
    assert "ep: 3 does not divide the model's 8 experts (num_experts)" in capsys.readouterr().err
