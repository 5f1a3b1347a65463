"""The Qwen3-30B-A3B shape of `tools/make_model.py`, its GPU training config, and the end-to-end weight
sync benchmark with an MoE checkpoint.

- The named shape (all 48 layers, and `--layers 8`) has the parameter counts of the published model.
- `configs/gpu_qwen3_30b_a3b_from_1.7b.yaml` (MoE student at EP=2, colocated rollout engine, vLLM
  teacher) passes validation and the start-up checks for two ranks, and the same file at a layout the
  experts cannot take is refused.
- `bench_weight_sync.py --e2e` with a tiny Qwen3-MoE made by `make_model.py` from the 30B-A3B shape's
  config (smaller dimensions, the same family keys): the Megatron student is built from the checkpoint,
  synced into a running vLLM engine that loads it, and the row carries the sync, the raw transfer
  and their ratio. On CPU (gloo, a vLLM CPU engine); on two GPUs the same test runs on them.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.loader import load_config
from opkd_mcore.data import ALPHABET
from opkd_mcore.models import tiny
from opkd_mcore.models.tiny import make_char_tokenizer, named_shape, tiny_hf_config
from opkd_mcore.train.preflight import preflight
from tests._dist import require_devices
from tools import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_CONFIG = os.path.join(ROOT, "configs", "gpu_qwen3_30b_a3b_from_1.7b.yaml")


def _hf_param_count(config) -> tuple[int, int]:
    """(all parameters, expert parameters) of the transformers model of `config`, built on the meta
    device: the reference is transformers' own model, not our arithmetic."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    named = list(model.named_parameters())
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if ".experts." in n)


def test_qwen3_30b_a3b_shape_has_the_published_parameter_counts():
    family, full = named_shape("qwen3-30b-a3b")
    config = tiny_hf_config(family, full)
    assert config.architectures == ["Qwen3MoeForCausalLM"] and config.num_experts == 128
    assert config.num_experts_per_tok == 8 and config.norm_topk_prob and not config.tie_word_embeddings
    total, experts = _hf_param_count(config)
    assert round(total / 1e9, 1) == 30.5  # Qwen3-30B-A3B: 30.5B in all (its model card)
    # 3.3B activated (the card's rounding): everything but the experts, plus 8 of each layer's 128
    assert 3.3e9 <= total - experts + experts * 8 / 128 < 3.4e9
    _, eight = named_shape("qwen3-30b-a3b", layers=8)
    total8, experts8 = _hf_param_count(tiny_hf_config(family, eight))
    assert (eight.num_layers, full.num_layers) == (8, 48) and experts8 * 6 == experts
    assert round(total8 / 1e9, 1) == 5.6
    with pytest.raises(ValueError, match="layers: expected a positive"):
        named_shape("qwen3-30b-a3b", layers=0)
    with pytest.raises(ValueError, match="shape: expected one of"):
        named_shape("qwen3-31b")


def _config_only(path, shape_name: str, layers: int | None = None) -> str:
    """A model directory with config.json and the tokenizer, no weights: what validation and the
    start-up checks read (an 11 GB random checkpoint would add nothing to them)."""
    family, shape = named_shape(shape_name, layers)
    tokenizer = make_char_tokenizer(ALPHABET)
    tiny_hf_config(family, shape, tokenizer).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def test_moe_training_config_passes_the_start_up_checks_at_ep2(tmp_path, monkeypatch):
    student = _config_only(tmp_path / "student", "qwen3-30b-a3b", layers=8)
    teacher = _config_only(tmp_path / "teacher", "qwen3-1.7b")
    overrides = [f"model.student={student}", f"teacher.teachers.0.model={teacher}",
                 f"run.output_dir={tmp_path / 'run'}"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node 2 sets it
    cfg = load_config(MOE_CONFIG, overrides)
    preflight(cfg)  # raises PreflightError listing every problem
    assert (cfg.parallel.ep, cfg.parallel.tp, cfg.optim.use_distributed_optimizer) == (2, 1, True)
    assert cfg.teacher.teachers[0].backend == "vllm" and cfg.loss.moe_aux_loss_coef > 0
    # the rollout and the teacher's top-64 rows fit the batch the experts' EP=2 x DP=2 layout trains
    assert cfg.rollout.prompts_per_step * cfg.rollout.n == cfg.parallel.global_batch_size
    # four expert ranks on two processes: the check sees the layout and names the key
    with pytest.raises(ConfigError, match="parallel.ep"):
        load_config(MOE_CONFIG, [*overrides, "parallel.ep=4"])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["tp1-disagg", "ep2-coloc"])
def test_e2e_sync_bench_of_a_megatron_student_tiny_qwen3_moe_from_the_30b_shape(tmp_path, monkeypatch,
                                                                                  layout):
    require_devices(2)
    base = tiny.NAMED_SHAPES["qwen3-30b-a3b"]
    small = replace(base, vocab_size=256, hidden_size=128, num_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=64, intermediate_size=256, max_position_embeddings=512,
                    extra={**base.extra, "num_experts": 8, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 64})
    monkeypatch.setitem(tiny.NAMED_SHAPES, "tiny-30b-a3b", small)
    monkeypatch.setitem(tiny.NAMED_SHAPE_FAMILIES, "tiny-30b-a3b", "qwen3_moe")
    model_dir = str(tmp_path / "model")
    assert make_model.main(["--shape", "tiny-30b-a3b", "--out", model_dir, "--dtype", "fp32"]) == 0
    with open(os.path.join(model_dir, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == ["Qwen3MoeForCausalLM"] and written["norm_topk_prob"] is True

    out, results = tmp_path / "e2e.json", tmp_path / "results.jsonl"
    device = [] if torch.cuda.is_available() else ["--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "tools/bench_weight_sync.py", "--e2e", "--shape", "tiny-30b-a3b",
                           "--layout", layout, "--model-dir", model_dir, *device, "--bucket-mb", "1",
                           "--warmup", "1", "--iters", "2", "--json", str(out), "--results", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(out.read_text())
    # every sync reached the engine: it reports the last version (warm-up + timed)
    assert row["engine_version"] == 3 and row["layout"] == layout
    assert row["parallel"] == ({"ep": 2} if layout == "ep2-coloc" else {"tp": 1})
    assert (row["architecture"], row["layers"], row["experts"], row["experts_per_token"]) == \
        ("Qwen3MoeForCausalLM", 2, 8, 2)
    # the bytes synced are the checkpoint's parameters (float32 on CPU, bf16 on a GPU), every expert
    numel = sum(p.numel() for p in _hf_state(model_dir).values())
    assert row["gbytes"] == round(numel * (4 if device else 2) / 1e9, 3)
    # the ratio is the raw transfer's median over the sync's, both timed in this run
    assert len(row["sync_all_s"]) == 2 and len(row["raw_all_s"]) == 2 and row["sync_s"] > 0
    medians = statistics.median(row["raw_all_s"]), statistics.median(row["sync_all_s"])
    assert row["ratio"] == round(medians[0] / medians[1], 3)
    assert "| e2e / raw |" in proc.stdout  # the printed table
    phases = row["phases"]
    if device:  # CPU: vLLM's layerwise reload held at most one layer incomplete: at EP=2 the buckets of
        # both sources come merged layer by layer (drained source after source it would hold both)
        assert phases["layers_in_flight_max"] == (1 if layout == "ep2-coloc" else 0)
    else:  # GPU: the Triton fused-MoE backend's experts load in place, timed syncs replaying the copies
        assert phases["layers_in_flight_max"] == 0 == phases["reload_s"] and phases["loaded_replayed"] > 0
    assert len(row["per_bucket"]) == row["buckets"]  # (source, bucket, wait s, load s) of each
    (recorded,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert recorded["results"][0]["ratio"] == row["ratio"] and recorded["results"][0]["experts"] == 8


def _hf_state(model_dir: str) -> dict:
    from safetensors.torch import load_file

    state = {}
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(model_dir, name)))
    return state
