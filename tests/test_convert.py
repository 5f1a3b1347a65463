"""`opkd convert` / tools/convert_ckpt.py: HF -> Megatron dist checkpoint (TP=2) -> HF, bit for bit.

The reference is the original checkpoint's bytes (safetensors read back with `safetensors`, no
opkd code involved). The conversion runs the way a user runs it: the script is started as a plain
process and spawns its own ranks over gloo.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from opkd_mcore.models.convert import MARKER_FILE
from opkd_mcore.models.convert import main as convert_main
from tests._dist import launcher_free_env

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "convert_ckpt.py")


def _read_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def _run_script(*args: str) -> subprocess.CompletedProcess:
    env = launcher_free_env(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def src_dir(tmp_path_factory):
    """Tiny Qwen2 (q/k/v biases, tied embeddings) in bf16 with a vocabulary TP=2 does not divide."""
    from transformers import AutoModelForCausalLM

    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    out = str(tmp_path_factory.mktemp("src"))
    shape = TinyModelShape(vocab_size=251, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)
    save_tiny_hf_model(out, "qwen2", shape, seed=11, init_std=0.05)
    # bf16 on disk: the conversion must keep the dtype, not pass through fp32 and back
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        os.remove(path)
    model.save_pretrained(out, max_shard_size="200KB")  # several shards + an index on input too
    return out


@pytest.fixture(scope="module")
def round_trip(src_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    mcore, back = str(root / "mcore"), str(root / "hf_back")
    to_mcore = _run_script("hf-to-mcore", "--hf-dir", src_dir, "--out", mcore, "--tp", "2")
    assert to_mcore.returncode == 0, to_mcore.stderr[-4000:]
    to_hf = _run_script("mcore-to-hf", "--mcore-dir", mcore, "--out", back, "--max-shard-size", "300KB")
    assert to_hf.returncode == 0, to_hf.stderr[-4000:]
    return mcore, back


def test_round_trip_is_bit_exact(src_dir, round_trip):
    original, converted = _read_safetensors(src_dir), _read_safetensors(round_trip[1])
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype == torch.bfloat16, name
        assert converted[name].shape == tensor.shape, name
        assert torch.equal(converted[name].view(torch.int16), tensor.view(torch.int16)), name


def test_output_is_a_loadable_hf_checkpoint(src_dir, round_trip):
    from transformers import AutoConfig, AutoTokenizer

    back = round_trip[1]
    with open(os.path.join(back, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all(os.path.isfile(os.path.join(back, s)) for s in shards)
    def config(path):
        return {k: v for k, v in AutoConfig.from_pretrained(path).to_dict().items() if k != "_name_or_path"}

    assert config(back) == config(src_dir)
    assert AutoTokenizer.from_pretrained(back)("12+3")["input_ids"] == \
        AutoTokenizer.from_pretrained(src_dir)("12+3")["input_ids"]


def test_mcore_checkpoint_records_its_origin(round_trip):
    mcore = round_trip[0]
    with open(os.path.join(mcore, "opkd_checkpoint.json")) as f:
        meta = json.load(f)
    assert meta["contents"] == ["model"]
    assert meta["architecture"] == "Qwen2ForCausalLM"
    assert meta["params_dtype"] == "bfloat16"
    assert meta["saved_with"] == {"tp": 2, "pp": 1, "vpp": None}
    assert os.path.isfile(os.path.join(mcore, "metadata.json"))
    assert os.path.isfile(os.path.join(mcore, "hf", "tokenizer.json"))


def test_outputs_carry_the_marker_that_force_looks_for(src_dir, round_trip):
    for path, command, inputs in zip(round_trip, ("hf-to-mcore", "mcore-to-hf"),
                                     ({"hf_dir": src_dir}, {"mcore_dir": round_trip[0]})):
        with open(os.path.join(path, MARKER_FILE)) as f:
            marker = json.load(f)
        assert marker["written_by"] == f"opkd convert {command}" and marker["inputs"] == inputs


def test_refuses_to_overwrite_without_force(round_trip, capsys):
    mcore, back = round_trip
    marker = os.path.getmtime(os.path.join(back, "model.safetensors.index.json"))
    assert convert_main(["mcore-to-hf", "--mcore-dir", mcore, "--out", back]) == 2
    assert "--force" in capsys.readouterr().err
    assert os.path.getmtime(os.path.join(back, "model.safetensors.index.json")) == marker


def test_force_never_deletes_a_foreign_directory(round_trip, tmp_path, capsys):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert convert_main(["mcore-to-hf", "--mcore-dir", round_trip[0], "--out", str(foreign), "--force"]) == 2
    assert "not a checkpoint written by this tool" in capsys.readouterr().err
    assert (foreign / "keep.txt").read_text() == "mine"


def test_unsupported_architecture(src_dir, tmp_path, capsys):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    for name in os.listdir(src_dir):
        if name != "config.json":
            os.link(os.path.join(src_dir, name), bad / name)
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    assert convert_main(["hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "Qwen3ForCausalLM" in err


def test_tp_not_dividing_heads(src_dir, tmp_path, capsys):
    assert convert_main(["hf-to-mcore", "--hf-dir", src_dir, "--out", str(tmp_path / "o"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "tp: 3 does not divide num_attention_heads=4" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("direction,flag,missing", [
    ("hf-to-mcore", "--hf-dir", "config.json"),
    ("hf-to-mcore", "--hf-dir", "safetensors"),
    ("mcore-to-hf", "--mcore-dir", "opkd_checkpoint.json"),
])
def test_missing_files(src_dir, tmp_path, capsys, direction, flag, missing):
    empty = tmp_path / "in"
    empty.mkdir()
    if missing == "safetensors":  # a config but no weights
        (empty / "config.json").write_text(open(os.path.join(src_dir, "config.json")).read())
    assert convert_main([direction, flag, str(empty), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert missing in err and str(empty) in err
