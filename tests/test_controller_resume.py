"""`opkd train ... controller.kind=ray run.schedule=async`, the driver killed after a checkpoint and
resumed (~2 min on 2 cores): prompts in flight at the checkpoint are generated again, none is lost or
trained twice, the data position continues exactly, and staleness stays within its bound.

Real pieces: the `opkd train` CLI starting its own local Ray cluster, two trainer ranks (Megatron,
DP=2: each pulls only its micro-batches' teacher rows), a vLLM CPU rollout engine, an hf teacher, a
SIGKILL of the driver's whole process tree (Ray's processes and the engines included).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from opkd_mcore.train.metrics import read_jsonl
from opkd_mcore.train.samples_log import audit, read_samples

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASET, PROMPTS, N, STEPS, SAVE_EVERY, STALENESS = 10, 2, 2, 12, 2, 1


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from opkd_mcore.data import ALPHABET
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    root = tmp_path_factory.mktemp("controller_resume")
    shape = TinyModelShape(vocab_size=32, hidden_size=128, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64)
    cfg = {
        "model": {"student": save_tiny_hf_model(str(root / "student"), "qwen3", shape, seed=1,
                                                alphabet=ALPHABET)},
        "parallel": {"world_size": 2, "micro_batch_size": 1, "global_batch_size": PROMPTS * N},
        "loss": {"support": "teacher"},
        "rollout": {"prompts_per_step": PROMPTS, "n": N, "max_new_tokens": 4, "max_model_len": 64},
        "teacher": {"teachers": [{"backend": "hf", "top_k": 4, "model": save_tiny_hf_model(
            str(root / "teacher"), "qwen3", shape, seed=2, alphabet=ALPHABET, init_std=0.1)}]},
        "data": {"num_train": DATASET, "num_eval": 2},
        "logging": {"progress_bar": False},
        "checkpoint": {"save_every": SAVE_EVERY, "keep_last": 2, "export_hf_at_end": True},
        "run": {"steps": STEPS, "schedule": "async", "max_staleness": STALENESS,
                "output_dir": str(root / "run")},
        "controller": {"kind": "ray"},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), str(root / "run")


def _launch(config: str, out: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "opkd_mcore.cli", "train", "--config", config, *extra]
    with open(out + ".log", "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _log(out: str) -> str:
    with open(out + ".log") as f:
        return f.read()


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and every descendant: Ray's own processes, its actors, the vLLM engine."""
    import psutil

    root = psutil.Process(proc.pid)
    victims = [root, *root.children(recursive=True)]
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)
    proc.wait()


def test_killed_driver_resumes_with_every_prompt_trained_once(config):
    from opkd_mcore.data import PromptSampler

    path, out = config
    proc = _launch(path, out)
    marker = os.path.join(out, "checkpoints", "latest")
    deadline = time.monotonic() + 900
    while not os.path.exists(marker):
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{_log(out)[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint within the timeout"
        time.sleep(0.05)
    _kill_tree(proc)
    killed_at = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert len(killed_at) < STEPS and not os.path.exists(os.path.join(out, "student_hf"))
    with open(marker) as f:
        checkpoint = os.path.join(out, "checkpoints", f.read().strip())
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        saved = json.load(f)
    in_flight = saved["sampler"]["outstanding"]
    assert in_flight, "nothing was in flight at the checkpoint: the re-queue path went untested"

    proc = _launch(path, out, "--resume")
    assert proc.wait(timeout=900) == 0, _log(out)[-4000:]
    assert "resumed from" in _log(out)
    metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(STEPS))
    rows = read_samples(out)
    report = audit(rows, N, DATASET)
    assert report.ok, report
    assert report.trained == STEPS * PROMPTS * N and report.max_staleness <= STALENESS
    assert {r["version_trained"] for r in rows if r["step"] == saved["step"]} == {saved["weight_version"]}
    # the data position is exact: one engine generates in draw order, so the trained prompts are the
    # sampler's draws, in order, across the kill (the in-flight ones first after the resume)
    trained = [(r["epoch"], r["prompt_index"]) for r in rows if r["sample_index"] == 0]
    sampler = PromptSampler(DATASET, PROMPTS, seed=0)
    draws = [(e, i) for e, i in _draws_with_epochs(sampler, STEPS)]
    assert trained == draws
    resumed_first = trained[saved["step"] * PROMPTS:saved["step"] * PROMPTS + len(in_flight)]
    assert resumed_first == [(e, i) for e, i, *_ in in_flight]
    assert os.path.isfile(os.path.join(out, "student_hf", "config.json"))


def _draws_with_epochs(sampler, steps):
    out = []
    for _ in range(steps):
        state = sampler.state_dict()
        batch = sampler.next_batch()
        out += [(state["epoch"] + (state["position"] + j) // sampler.size, i) for j, i in enumerate(batch)]
    return out
