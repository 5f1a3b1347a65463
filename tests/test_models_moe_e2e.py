"""`opkd train` end to end with an MoE student at EP=2 and an MoE Megatron teacher in its step.

Two ranks under torchrun (gloo): a tiny Qwen3-MoE student (8 experts, top-2), its experts split
over EP=2, with the router load-balancing loss on; the teacher is a tiny Qwen2-MoE (gated shared
expert) run inside the student's step on the same EP groups (dense TP-sharded logits). Rollouts come
from a vLLM CPU engine on rank 0 that receives the MoE student's weights after every step (each
EP rank sends its own experts). The run must finish, the loss must go down, and the MoE metrics
must be there and sane; the final checkpoint converts to an HF model that `transformers` loads.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import free_port, require_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_opkd_train_moe_student_ep2_with_moe_megatron_teacher(tmp_path):
    require_devices(2)
    shape = dict(vocab_size=32, hidden_size=128, num_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 max_position_embeddings=64)
    student = save_tiny_hf_model(str(tmp_path / "student"), "qwen3_moe", TinyModelShape(**shape), seed=1,
                                 alphabet=ALPHABET)
    teacher = save_tiny_hf_model(str(tmp_path / "teacher"), "qwen2_moe", TinyModelShape(**shape), seed=2,
                                 alphabet=ALPHABET, init_std=0.1)
    out = str(tmp_path / "run")
    cfg = {
        "model": {"student": student},
        "parallel": {"ep": 2, "micro_batch_size": 2, "global_batch_size": 8},
        "loss": {"divergence": "forward_kl", "support": None, "moe_aux_loss_coef": 0.01},
        "rollout": {"prompts_per_step": 4, "n": 2, "max_new_tokens": 4, "max_model_len": 64},
        "teacher": {"teachers": [{"backend": "megatron", "model": teacher}]},
        "optim": {"lr": 1e-3},
        "data": {"num_train": 50, "num_eval": 10},
        "logging": {"progress_bar": False},
        "checkpoint": {"save_at_end": False, "export_hf_at_end": True},
        "run": {"steps": 3, "output_dir": out},
    }
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), "-m", "opkd_mcore.cli"]
    proc = subprocess.run([*launcher, "train", "--config", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]

    assert len(rows) == 3
    losses = [r["train/loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    for r in rows:
        assert r["train/update_applied"] == 1.0 and r["teacher/nonfinite_rows"] == 0
        assert 0.5 < r["moe/aux_loss"] < 8.0  # E * sum_e f_e P_e: 1.0 for uniform routing, E at most
        assert r["moe/expert_load_max"] >= 1.0 >= r["moe/expert_load_min"] >= 0.0
    # the exported student is an HF Qwen3-MoE checkpoint with every expert
    from safetensors import safe_open
    from transformers import AutoConfig

    export = os.path.join(out, "student_hf")
    assert AutoConfig.from_pretrained(export).architectures == ["Qwen3MoeForCausalLM"]
    names = set()
    for name in os.listdir(export):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(export, name), framework="pt") as f:
                names |= set(f.keys())
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names
