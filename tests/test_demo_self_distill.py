"""`opkd demo --variant self_distill --quick` end to end: one model trained to copy an answer it is
given, then distilled on-policy from itself with the answer in the teacher's prompt (vLLM rollouts of
the plain prompts, the self teacher in the Megatron step, weight sync), and evaluated from the files.

The model with the context must be clearly better than without it; without it, the held-out exact
match must rise; and the reported figures must recompute with plain `transformers` from
`student_init/`, `student_hf/` and `eval.jsonl` alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.test_demo import _plain_transformers_accuracy

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("self_distill") / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = ["demo", "--variant", "self_distill", "--quick", "--out", out]
    proc = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(out, "summary.json")) as f:
        return out, json.load(f), proc.stdout


def test_the_student_learns_from_itself_with_the_context(demo_dir):
    out, summary, stdout = demo_dir
    # the privileged context is usable: the model mostly copies the answer it is given, and cannot compute it
    assert summary["teacher_with_context_accuracy"] >= 0.7, summary
    assert summary["student_accuracy_before"] <= 0.2, summary
    # without the context, the held-out exact match rises (quick: 20 one-digit problems)
    assert summary["student_accuracy_after"] >= summary["student_accuracy_before"] + 0.3, summary
    assert "| student after |" in stdout
    for name in ("metrics.jsonl", "distill.png", "eval.jsonl", "config.yaml",
                 "student_init/config.json", "student_hf/config.json", "sft_compute.jsonl", "sft_copy.jsonl"):
        assert os.path.exists(os.path.join(out, name)), name
    assert not os.path.exists(os.path.join(out, "teacher_hf"))  # no teacher model
    with open(os.path.join(out, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["teacher"]["teachers"][0]["backend"] == "self" and not cfg["teacher"]["teachers"][0]["model"]
    assert cfg["data"]["teacher_prompt_template"] == "{answer}|{prompt}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(summary["distill_steps"]))
    assert all(r["timing/teacher"] == 0.0 for r in rows)  # scored inside the student's step
    assert "teacher/top1_agreement" in rows[0] and "eval/accuracy" in rows[-1]


def test_reported_accuracies_recompute_with_plain_transformers(demo_dir):
    out, summary, _ = demo_dir
    with open(os.path.join(out, "eval.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert all(r["teacher_prompt"] == f"{r['answer']}|{r['prompt']}" for r in records)
    with_context = [{"prompt": r["teacher_prompt"], "answer": r["answer"]} for r in records]
    start, after = os.path.join(out, "student_init"), os.path.join(out, "student_hf")
    assert _plain_transformers_accuracy(start, records) == pytest.approx(summary["student_accuracy_before"])
    assert _plain_transformers_accuracy(after, records) == pytest.approx(summary["student_accuracy_after"])
    assert _plain_transformers_accuracy(start, with_context) == \
        pytest.approx(summary["teacher_with_context_accuracy"])
