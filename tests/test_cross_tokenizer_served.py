"""A served teacher with another tokenizer, end to end: `opkd train` with `loss.cross_tokenizer: gold`
and the teacher behind a server gives the per-step losses of the same run with the in-process vLLM
teacher of the same checkpoint. The two runs share the student, the data, the seeds and the way the
rows are scored; only the teacher's transport differs (HTTP, the client's vocabulary probe of the
teacher's ids, the wire format), so any difference is the served path's.

The teacher reads two digits as one token (`tests/_tokenizers.digit_pair_tokenizer`), the student
one character: a response's lone digits and operators are exact spans, its digit pairs ULD spans,
so gold's two terms both see served rows. Routes: `device` (`opkd teacher-serve`, the packed top-k
route) and `prompt_logprobs` (the stock vLLM OpenAI server, `vllm serve`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from opkd_mcore.teacher.serve import TeacherServer, TeacherServerConfig
from tests._dist import free_port
from tests._tokenizers import digit_pair_tokenizer
from tests.conftest import ENGINE_MEMORY, vllm_fp32_rel

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 32
TOP_K = 4
# head_dim 64: vLLM's CPU attention has no kernel for 16 or 32; the vocabulary is the tokenizer's
# (padded up to it), so every id the student samples is a character the teacher can re-tokenize
SHAPE = TinyModelShape(vocab_size=16, hidden_size=64, num_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64, intermediate_size=64,
                       max_position_embeddings=2 * MAX_MODEL_LEN)
ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("xtok_served")
    return {"root": root,
            "student": save_tiny_hf_model(str(root / "student"), "qwen3", SHAPE, seed=1, alphabet=ALPHABET),
            "teacher": save_tiny_hf_model(str(root / "teacher"), "qwen3", SHAPE, seed=2, init_std=0.2,
                                          tokenizer=digit_pair_tokenizer())}


def _train(models, name: str, teacher: dict) -> subprocess.Popen:
    """`opkd train` of two steps with `teacher` (its backend's fields), started in the background."""
    out = str(models["root"] / name)
    cfg = {
        "model": {"student": models["student"], "params_dtype": "float32"},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 4},
        "loss": {"divergence": "forward_kl", "support": "teacher", "mass": "tail", "cross_tokenizer": "gold"},
        "rollout": {"prompts_per_step": 2, "n": 2, "max_new_tokens": 4, "max_model_len": MAX_MODEL_LEN,
                    "gpu_memory_utilization": ENGINE_MEMORY},
        "teacher": {"teachers": [{"name": "pairs", "model": models["teacher"], "top_k": TOP_K, **teacher}]},
        "optim": {"lr": 1e-2},
        "data": {"task": "addition", "task_digits": 1, "num_train": 16, "num_eval": 4},
        "logging": {"progress_bar": False},
        "checkpoint": {"save_at_end": False, "export_hf_at_end": False},
        "run": {"steps": 2, "output_dir": out, "seed": 7},
    }
    path = models["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(models["root"] / f"{name}.log", "w") as log:   # a file: a full pipe would stall the run
        return subprocess.Popen([sys.executable, "-m", "opkd_mcore.cli", "train", "--config", str(path)],
                                cwd=ROOT, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT)


def _finish(models, name: str, proc: subprocess.Popen) -> tuple[list[dict], str]:
    proc.wait(timeout=600)
    log = (models["root"] / f"{name}.log").read_text()
    assert proc.returncode == 0, log[-6000:]
    with open(os.path.join(str(models["root"] / name), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], log


@pytest.mark.parametrize("scoring", ["device", "prompt_logprobs"])
def test_served_teacher_across_tokenizers_matches_the_in_process_teacher(models, scoring):
    server_cfg = TeacherServerConfig(model=models["teacher"], k=TOP_K, port=free_port(), dtype="float32",
                                     scoring=scoring, gpu_memory_utilization=ENGINE_MEMORY)
    server_log = str(models["root"] / f"server_{scoring}.log")
    local_name, served_name = f"in_process_{scoring}", f"served_{scoring}"
    local_teacher = {"backend": "vllm", "dtype": "float32", "scoring": scoring}
    with TeacherServer(server_cfg, log_path=server_log, env=ENV) as server:
        # on CPU the reference run goes while the server starts (both mostly wait on imports and engine
        # start-up); on a GPU engines start one at a time: vLLM's start-up measures the device's free
        # memory, and another engine allocating or freeing meanwhile fails it ("Error in memory profiling")
        local_proc = None if torch.cuda.is_available() else _train(models, local_name, local_teacher)
        try:
            try:
                server.wait_ready(timeout_s=600)
            except Exception:
                with open(server_log) as f:
                    pytest.fail(f"teacher server did not start:\n{f.read()[-3000:]}")
            served, served_log = _finish(models, served_name, _train(models, served_name, {
                "backend": "remote", "url": server.url, "scoring": scoring}))
            local_proc = local_proc or _train(models, local_name, local_teacher)
            local, _ = _finish(models, local_name, local_proc)
        finally:
            if local_proc is not None and local_proc.poll() is None:
                local_proc.kill()
                local_proc.wait()
    assert f"pairs across tokenizers (loss.cross_tokenizer: gold): remote teacher served at {server.url}" \
        in served_log
    assert len(served) == len(local) == 2
    # float32 scoring on both sides; the rows may come from differently shaped engine batches, so they
    # differ in float32's last bits, which TF32 (vLLM's attention on a GPU) rounds either way
    rel = vllm_fp32_rel(1e-5)
    for key in ("train/loss", "train/grad_norm", "xtok/uld", "xtok/exact_teacher_mass",
                "teacher/top1_agreement"):
        assert [r[key] for r in served] == pytest.approx([r[key] for r in local], rel=rel, abs=1e-7), key
    for key in ("xtok/exact_rows", "xtok/uld_rows", "rollout/response_tokens"):
        assert [r[key] for r in served] == [r[key] for r in local], key   # the same samples and spans
    assert sum(r["xtok/exact_rows"] for r in served) > 0 and sum(r["xtok/uld_rows"] for r in served) > 0
