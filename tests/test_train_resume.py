"""`opkd train` under `torchrun --nproc_per_node 2` with TP=2: kill after a checkpoint, resume, and
the resumed run's metrics equal those of an uninterrupted run with the same seed.

Weights go to the rollout engine every 2 steps, so the resumed engine must get the weights (and the
version) the uninterrupted run's engine had at the checkpoint, not merely the latest ones.

Real pieces: torchrun, Megatron TP=2 over gloo, the vLLM rollout engine on rank 0 with weight sync,
a transformers-forward top-k teacher, Megatron distributed checkpoints.
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
from tests._dist import require_devices

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY, SYNC_EVERY = 6, 2, 2
# wall-clock facts, not results: they differ between runs by design
NONDETERMINISTIC = ("timing/", "perf/")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_devices(2)
    from opkd_mcore.data import ALPHABET
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    root = tmp_path_factory.mktemp("resume")
    shape = TinyModelShape(vocab_size=32, hidden_size=128, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64)
    student = save_tiny_hf_model(str(root / "student"), "qwen3", shape, seed=1, alphabet=ALPHABET)
    teacher = save_tiny_hf_model(str(root / "teacher"), "qwen3", shape, seed=2, alphabet=ALPHABET)
    cfg = {
        "model": {"student": student},
        "parallel": {"tp": 2, "micro_batch_size": 2, "global_batch_size": 8},
        "loss": {"support": "teacher", "divergence": "jsd", "beta": 0.3},
        "rollout": {"prompts_per_step": 4, "n": 2, "max_new_tokens": 4, "max_model_len": 64},
        "teacher": {"teachers": [{"backend": "hf", "model": teacher, "top_k": 4}]},
        "optim": {"lr": 1e-3},
        "weight_sync": {"every_steps": SYNC_EVERY},
        "data": {"num_train": 50, "num_eval": 10},
        "logging": {"progress_bar": False},
        "checkpoint": {"save_every": SAVE_EVERY, "keep_last": 2},
        "run": {"steps": STEPS},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return root, str(path)


def _launch(config: str, out: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "opkd_mcore.cli", "train", "--config", config, f"run.output_dir={out}",
           *extra]
    log = open(out + ".log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _free_port() -> int:
    from tests._dist import free_port

    return free_port()


def _wait(proc: subprocess.Popen, out: str, timeout_s: float = 1200) -> None:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise
    assert rc == 0, f"torchrun exited with {rc}; log tail:\n{open(out + '.log').read()[-4000:]}"


def _kill_after_first_checkpoint(proc: subprocess.Popen, out: str, timeout_s: float = 1200) -> None:
    marker = os.path.join(out, "checkpoints", "latest")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker):
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{open(out + '.log').read()[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint within the timeout"
        time.sleep(0.05)
    _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every descendant: its ranks run in sessions of their own, and rank 0
    owns the vLLM engine processes."""
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


def _deterministic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC)} for r in rows]


def test_killed_and_resumed_run_matches_uninterrupted(setup):
    root, config = setup
    full, broken = str(root / "full"), str(root / "broken")
    # the uninterrupted run also profiles one step: the traces must not change what it computes
    _wait(_launch(config, full, "logging.profile_steps=[1]"), full)
    reference = read_jsonl(os.path.join(full, "metrics.jsonl"))
    assert [r["step"] for r in reference] == list(range(STEPS))
    _check_profile(os.path.join(full, "profile"), step=1, ranks=2)

    proc = _launch(config, broken)
    _kill_after_first_checkpoint(proc, broken)
    killed_at = read_jsonl(os.path.join(broken, "metrics.jsonl"))
    assert len(killed_at) < STEPS, "the run finished before it could be killed"
    assert not os.path.exists(os.path.join(broken, "student_hf")), "the killed run kept going"

    _wait(_launch(config, broken, "--resume"), broken)
    resumed = read_jsonl(os.path.join(broken, "metrics.jsonl"))
    assert [r["step"] for r in resumed] == list(range(STEPS))
    log = open(broken + ".log").read()
    assert "resumed from" in log
    for want, got in zip(_deterministic(reference), _deterministic(resumed)):
        assert want.keys() == got.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (want["step"], key)
    # the final student is exported once, by the resumed run
    assert os.path.isfile(os.path.join(broken, "student_hf", "config.json"))


def _check_profile(folder: str, step: int, ranks: int) -> None:
    """Each rank traced the step (a Chrome trace holding the model's matrix products, and the operator
    table), and no other step."""
    assert sorted(os.listdir(folder)) == sorted(f"step{step}.rank{r}.{ext}" for r in range(ranks)
                                                for ext in ("json", "txt"))
    for r in range(ranks):
        with open(os.path.join(folder, f"step{step}.rank{r}.json")) as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        assert {"aten::mm", "aten::addmm", "aten::matmul"} & names, sorted(names)[:40]
        table = open(os.path.join(folder, f"step{step}.rank{r}.txt")).read()
        assert "Self CPU" in table and "aten::" in table, table[:2000]
