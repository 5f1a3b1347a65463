"""`opkd demo --variant cross_tokenizer --quick` end to end: a char-level student distilled on-policy
from a teacher trained with another tokenizer (operators glued to the next digit, other ids and special
tokens),
`loss.cross_tokenizer: gold`; the reported accuracy recomputed here with plain `transformers`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_demo import KEYS, _plain_transformers_accuracy, _records

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo_xtok") / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [sys.executable, "-m", "opkd_mcore.cli", "demo", "--quick", "--variant", "cross_tokenizer",
               "--out", out]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout


def test_student_learns_from_a_teacher_with_another_tokenizer(demo_dir):
    from transformers import AutoTokenizer

    out, stdout = demo_dir
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert set(KEYS) <= set(summary) and summary["cross_tokenizer"] == "gold"
    assert summary["kl_after"] < summary["kl_before"], summary
    assert summary["student_accuracy_after"] > summary["student_accuracy_before"], summary
    assert "| student after |" in stdout
    student, teacher = (AutoTokenizer.from_pretrained(os.path.join(out, name))
                        for name in ("student_hf", "teacher_hf"))
    assert student.get_vocab() != teacher.get_vocab() and teacher.eos_token != student.eos_token
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == summary["distill_steps"]
    for key in ("train/loss", "xtok/exact_rows", "xtok/uld_rows", "teacher/top1_agreement", "timing/teacher"):
        assert key in rows[0], key
    assert all(row["xtok/exact_rows"] > 0.5 for row in rows)   # answer digits and the end of turn map 1:1


def test_reported_accuracy_recomputes_with_plain_transformers(demo_dir):
    out, _ = demo_dir
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    records = _records(out)
    assert _plain_transformers_accuracy(os.path.join(out, "student_hf"), records) == \
        pytest.approx(summary["student_accuracy_after"])
    assert _plain_transformers_accuracy(os.path.join(out, "teacher_hf"), records) == \
        pytest.approx(summary["teacher_accuracy"])
