"""RemoteVllmTeacher against a real vLLM OpenAI server (CPU build) started and stopped by this module."""
import json
import os
import threading
import time

import pytest
import torch

from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.teacher.base import MalformedTeacherOutputError, TeacherUnavailableError
from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher, parse_completion_response
from opkd_mcore.teacher.serve import TeacherServer, TeacherServerConfig
from tests._dist import free_port
from tests.test_teacher_vllm import SEQUENCES, assert_same_topk, reference_logprobs

pytestmark = pytest.mark.vllm
SERVER_MAX_LOGPROBS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("remote") / "tiny"), seed=7, init_std=0.1)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("remote_log") / "server.log")
    cfg = TeacherServerConfig(model=model_dir, k=SERVER_MAX_LOGPROBS, port=free_port(),
                              dtype="float32", max_model_len=64, served_model_name="teacher")
    srv = TeacherServer(cfg, log_path=log, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        srv.wait_ready(timeout_s=900)
    except Exception:
        srv.stop()
        with open(log) as f:
            pytest.fail(f"teacher server did not start:\n{f.read()[-3000:]}")
    yield srv
    srv.stop()


def client(server, **kw):
    kw = {"url": server.url, "k": 8, "max_retries": 1, "backoff_s": 0.05, **kw}
    return RemoteVllmTeacher(RemoteTeacherConfig(**kw))


def test_remote_topk_matches_transformers_over_concurrent_batches(server, model_dir):
    teacher = client(server, batch_size=2, max_concurrency=2)
    sequences = SEQUENCES + [s[::-1] for s in SEQUENCES]  # 6 sequences -> 3 requests
    scored = teacher.score(sequences)
    assert teacher.stats["requests"] == 3 and teacher.stats["retries"] == 0
    for seq, rows in zip(sequences, scored):
        assert_same_topk(rows, reference_logprobs(model_dir, seq), 8)


def test_k_above_server_max_logprobs_fails_before_scoring(server):
    teacher = client(server, k=SERVER_MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match=rf"k={SERVER_MAX_LOGPROBS + 1}.*{server.url}.*at most "
                                         rf"{SERVER_MAX_LOGPROBS} logprobs"):
        teacher.score(SEQUENCES)
    assert teacher.stats["requests"] == 0


def test_non_default_temperature_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"teacher\.temperature.*cannot honour 0\.7"):
        RemoteVllmTeacher(RemoteTeacherConfig(temperature=0.7))


def _top1(position: dict) -> dict:
    return next(e for e in position.values() if e["rank"] == 1)


def _real_payload(server, seqs):
    teacher = client(server)
    teacher.check_server()
    body = {"model": "teacher", "prompt": seqs, "max_tokens": 1, "prompt_logprobs": 8}
    return json.loads(teacher._http("/v1/completions", body))


@pytest.mark.parametrize("corrupt, match", [
    (lambda p: p["choices"].pop(), "expected 2 choices, got 1"),
    (lambda p: p["choices"][1]["prompt_logprobs"].pop(), "sequence 1: expected 3 prompt_logprobs"),
    (lambda p: _top1(p["choices"][0]["prompt_logprobs"][2]).update(logprob=float("nan")),
     "sequence 0, position 1: .*NaN"),
    (lambda p: p["choices"][0]["prompt_logprobs"][1].clear(), "sequence 0, position 0: expected 8"),
    (lambda p: p["choices"][0]["prompt_logprobs"].__setitem__(3, "oops"), "sequence 0: unreadable"),
])
def test_malformed_server_rows_name_the_request(server, corrupt, match):
    seqs = [SEQUENCES[0], SEQUENCES[1]]
    payload = _real_payload(server, seqs)
    parse_completion_response(payload, seqs, 8, "request 9 to X")  # the real answer parses
    corrupt(payload)
    with pytest.raises(MalformedTeacherOutputError, match=rf"request 9 to X.*{match}"):
        parse_completion_response(payload, seqs, 8, "request 9 to X")


def test_router_spreads_chunks_over_two_remote_replicas(server, model_dir):
    from opkd_mcore.teacher.router import TeacherRouter

    router = TeacherRouter({"math": [client(server), client(server)]}, chunk_size=1, max_workers=2)
    sequences = SEQUENCES * 2
    scored = router.score(sequences, [{"data_source": "math"}] * len(sequences))
    # timing decides the exact split; least-in-flight guarantees both used, never two on one
    pool = router.pools["math"]
    assert sum(pool.served) == len(sequences) and min(pool.served) >= 1, pool.served
    assert pool.peak_in_flight == [1, 1], pool.peak_in_flight
    for seq, rows in zip(sequences, scored):
        assert_same_topk(rows, reference_logprobs(model_dir, seq), 8)


def test_server_killed_mid_batch_gives_bounded_retries_then_error_naming_it(server):
    """Runs last in this module: it kills the module's server."""
    teacher = client(server, batch_size=1, max_concurrency=1, max_retries=2, backoff_s=0.1,
                     timeout_s=10)
    sequences = [[1] + [3 + (i + j) % 12 for j in range(20)] for i in range(3000)]
    errors = []

    def run():
        try:
            teacher.score(sequences)
        except Exception as err:  # the assertion below checks its type and message
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 120
    while teacher.stats["requests"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert teacher.stats["requests"] >= 2, "no request completed before the kill"
    server.stop(sig=9)
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert teacher.stats["requests"] < len(sequences), "the batch finished before the server died"
    assert len(errors) == 1 and isinstance(errors[0], TeacherUnavailableError), errors
    assert server.url in str(errors[0]) and "after 3 attempts" in str(errors[0])
    assert errors[0].address == server.url
    assert teacher.stats["retries"] == 2
