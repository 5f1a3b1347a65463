"""`opkd demo --quick` end to end: teacher SFT (Megatron) -> HF export -> on-policy distillation
(vLLM rollouts, teacher top-k, kd_loss in Megatron, weight sync) -> evaluation from the files.

The student's held-out KL to the teacher must fall and its exact-match accuracy must rise; the
reported accuracy is recomputed here with `transformers.generate` from `student_hf/` and
`eval.jsonl` alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("teacher_accuracy", "student_accuracy_before", "student_accuracy_after", "kl_before", "kl_after",
        "seconds")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", "demo", "--quick", "--out", out],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout


def test_student_learns_from_teacher(demo_dir):
    out, stdout = demo_dir
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert set(KEYS) <= set(summary)
    assert summary["kl_after"] < summary["kl_before"], summary
    assert summary["student_accuracy_after"] > summary["student_accuracy_before"], summary
    assert "| student after |" in stdout
    for name in ("metrics.jsonl", "distill.png", "eval.jsonl", "config.yaml", "teacher_hf/config.json",
                 "student_hf/config.json"):
        assert os.path.exists(os.path.join(out, name)), name
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) == summary["distill_steps"]
    for key in ("train/loss", "timing/rollout", "timing/teacher", "timing/train", "timing/weight_sync",
                "timing/step", "rollout/response_len_mean", "teacher/top1_agreement"):
        assert key in rows[0], key


@torch.no_grad()
def test_reported_accuracy_recomputes_with_transformers(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = demo_dir
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    student = os.path.join(out, "student_hf")
    tok = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    with open(os.path.join(out, "eval.jsonl")) as f:
        records = [json.loads(line) for line in f]
    correct = 0
    for r in records:
        prompt = [tok.bos_token_id] + tok.encode(r["prompt"], add_special_tokens=False)
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=len(r["answer"]) + 1, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        text = tok.decode(gen[0, len(prompt):], skip_special_tokens=True).replace(" ", "")
        correct += text == r["answer"]
    assert correct / len(records) == pytest.approx(summary["student_accuracy_after"])
