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


def _records(out):
    with open(os.path.join(out, "eval.jsonl")) as f:
        return [json.loads(line) for line in f]


@torch.no_grad()
def _plain_transformers_accuracy(model_dir: str, records) -> float:
    """Greedy `generate` the standard way: `tokenizer(prompt)` and nothing else of this project."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    for r in records:
        inputs = tok(r["prompt"], return_tensors="pt")
        gen = model.generate(**inputs, max_new_tokens=len(r["answer"]) + 1, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        text = tok.decode(gen[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += text.replace(" ", "") == r["answer"]
    return correct / len(records)


def test_reported_accuracy_recomputes_with_plain_transformers(demo_dir):
    out, _ = demo_dir
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    records = _records(out)
    assert _plain_transformers_accuracy(os.path.join(out, "student_hf"), records) == \
        pytest.approx(summary["student_accuracy_after"])
    assert _plain_transformers_accuracy(os.path.join(out, "teacher_hf"), records) == \
        pytest.approx(summary["teacher_accuracy"])


def test_vllm_text_prompts_reproduce_the_reported_accuracy(demo_dir):
    """What `vllm serve student_hf` would answer: text prompts, the checkpoint's own tokenizer."""
    import vllm

    from opkd_mcore.rollout.vllm_rollout import shutdown_llm
    from tests.conftest import engine_kwargs

    out, _ = demo_dir
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    records = _records(out)
    llm = vllm.LLM(os.path.join(out, "student_hf"), dtype="float32", enforce_eager=True, max_model_len=64,
                   **engine_kwargs())
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=len(records[0]["answer"]) + 1)
        outputs = llm.generate([r["prompt"] for r in records], params, use_tqdm=False)
    finally:
        shutdown_llm(llm)
    correct = sum(o.outputs[0].text.replace(" ", "") == r["answer"] for o, r in zip(outputs, records))
    assert correct / len(records) == pytest.approx(summary["student_accuracy_after"])
