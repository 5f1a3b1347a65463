"""The rollout engine's modes: how requests are seeded, whether vLLM detokenizes, where its core runs."""
import json
import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.rollout import RolloutConfig, SamplingConfig
from opkd_mcore.rollout.engine_env import IN_PROCESS_VARIABLE, engine_environment
from opkd_mcore.rollout.vllm_rollout import VllmRollout, sample_seed
from tests.conftest import ENGINE_MEMORY, VLLM_FP32_LOGPROB_ATOL

PROMPTS = [[1, 4, 5, 6], [1, 7, 8], [1, 9, 10, 11, 12]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("before", [None, "1"])
def test_engine_environment_builds_the_engine_core_in_process_and_restores(monkeypatch, before):
    monkeypatch.setenv("RANK", "3")
    if before is None:
        monkeypatch.delenv(IN_PROCESS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(IN_PROCESS_VARIABLE, before)
    with engine_environment(in_process=True):
        assert os.environ[IN_PROCESS_VARIABLE] == "0"
        assert "RANK" not in os.environ
    assert os.environ.get(IN_PROCESS_VARIABLE) == before
    assert os.environ["RANK"] == "3"
    with engine_environment():  # the default leaves vLLM's own choice alone
        assert os.environ.get(IN_PROCESS_VARIABLE) == before


class _OneStep(SimpleNamespace):
    """vLLM's flat logprobs of a one-token response."""

    def __len__(self):
        return 1


class _FakeLLM:
    """Records what `VllmRollout.generate` asks vLLM for; answers one token per request."""

    def __init__(self):
        self.calls = []

    def generate(self, inputs, params, use_tqdm):
        self.calls.append((inputs, params))
        lps = _OneStep(start_indices=[0], token_ids=[7], logprobs=[-0.5])
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7], logprobs=lps, finish_reason="length")
                                         for _ in range(p.n)]) for p in params]


def _engine(**cfg) -> VllmRollout:
    """A VllmRollout around `_FakeLLM` (no engine is built)."""
    engine = VllmRollout.__new__(VllmRollout)
    engine.cfg, engine.llm, engine.model_dir = RolloutConfig(**cfg), _FakeLLM(), "fake"
    engine._version, engine._asleep, engine._paused, engine._in_flight = 0, False, False, 0
    engine._cond = threading.Condition()
    return engine


def test_per_sample_seeds_make_a_seeded_request_per_sample():
    engine = _engine()
    samples = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=1), seeds=[5, 6, 7])
    inputs, params = engine.llm.calls[0]
    assert [p.seed for p in params] == [sample_seed(s, j) for s in (5, 6, 7) for j in range(2)]
    assert [p.n for p in params] == [1] * 6
    assert [i["prompt_token_ids"] for i in inputs] == [p for p in PROMPTS for _ in range(2)]
    assert not any(p.detokenize for p in params)  # nothing reads the text
    assert [s.group_id for s in samples] == [0, 0, 1, 1, 2, 2]


def test_engine_seeds_make_one_unseeded_request_per_prompt():
    engine = _engine(per_sample_seeds=False, detokenize=True)
    samples = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=1, seed=9), seeds=[5, 6, 7])
    inputs, params = engine.llm.calls[0]
    assert [(p.n, p.seed, p.detokenize) for p in params] == [(2, None, True)] * 3
    assert [i["prompt_token_ids"] for i in inputs] == PROMPTS
    assert [s.group_id for s in samples] == [0, 0, 1, 1, 2, 2]


GUARD = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from opkd_mcore.rollout import RolloutConfig
    from opkd_mcore.rollout.vllm_rollout import check_in_process_engine

    check_in_process_engine(RolloutConfig(engine_in_process=True))  # no world: allowed
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    try:
        check_in_process_engine(RolloutConfig(engine_in_process=True))
        print("ALLOWED")
    except ValueError as e:
        print("REFUSED " + str(e))
    check_in_process_engine(RolloutConfig(engine_in_process=False))
    # at TP > 1 the workers are processes of their own: only the engine core joins this one
    check_in_process_engine(RolloutConfig(engine_in_process=True, tensor_parallel_size=2))
    dist.destroy_process_group()
    print("DONE")
""")


def test_in_process_engine_core_is_refused_beside_a_distributed_world(tmp_path):
    """A process of its own: the suite's process may hold a torch.distributed world already."""
    run = subprocess.run([sys.executable, "-c", GUARD, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.split("\n")
    refused = [line for line in lines if line.startswith(("REFUSED", "ALLOWED"))]
    assert len(refused) == 1 and refused[0].startswith("REFUSED"), run.stdout
    assert "engine_in_process" in refused[0] and "torch.distributed world" in refused[0], refused[0]
    assert "DONE" in lines, run.stdout


CHILD = textwrap.dedent("""
    import json, sys
    from opkd_mcore.rollout import RolloutConfig, SamplingConfig
    from opkd_mcore.rollout.vllm_rollout import VllmRollout

    model_dir, prompts, memory = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    cfg = RolloutConfig(dtype="float32", max_model_len=128, logprobs_mode="raw_logprobs",
                        gpu_memory_utilization=memory, engine_in_process=True, per_sample_seeds=False)
    engine = VllmRollout(model_dir, cfg)
    client = type(engine.llm.llm_engine.engine_core).__name__
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8)
    samples = engine.generate(prompts, sampling, seeds=[5, 6, 7])
    try:
        VllmRollout(model_dir, cfg)
        second = "built"
    except ValueError as e:
        second = str(e)
    engine.shutdown()
    print("RESULT " + json.dumps({"client": client, "second": second, "samples": [
        [s.group_id, s.sequence, len(s.prompt_ids), s.response_logprobs] for s in samples]}))
""")


@pytest.mark.vllm
def test_engine_core_in_process_generates_the_models_logprobs(tmp_path):
    """A separate process: an engine core built in a process fixes vLLM's settings for it."""
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_hf_model(str(tmp_path / "tiny"), seed=3, init_std=0.1)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", CHILD, model_dir, json.dumps(PROMPTS), str(ENGINE_MEMORY)],
                         env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["client"] == "InprocClient"  # vLLM's engine core in the caller's process
    # a second one in that process is refused (the first one's worker made the process a world of 1)
    assert out["second"].startswith("rollout.engine_in_process: "), out["second"]
    assert [g for g, *_ in out["samples"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    for group, sequence, prompt_len, logprobs in out["samples"]:
        assert sequence[:prompt_len] == PROMPTS[group]
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0]
        ref = torch.log_softmax(logits[prompt_len - 1:-1], dim=-1)
        expected = ref[torch.arange(len(sequence) - prompt_len), torch.tensor(sequence[prompt_len:])]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected,
                                   atol=VLLM_FP32_LOGPROB_ATOL, rtol=0)
