"""RemoteVllmTeacher against a real vLLM OpenAI server (CPU build) started and stopped by this module,
and against a small fake server for the checks that need a server with another vocabulary."""
import http.server
import json
import logging
import math
import os
import threading
import time
from contextlib import contextmanager

import pytest

from opkd_mcore.config import load_config
from opkd_mcore.models.tiny import save_tiny_hf_model
from opkd_mcore.teacher.base import MalformedTeacherOutputError, TeacherError, TeacherUnavailableError
from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher, parse_completion_response
from opkd_mcore.teacher.serve import TeacherServer, TeacherServerConfig
from opkd_mcore.train.preflight import PreflightError, preflight
from tests._dist import free_port
from tests.conftest import ENGINE_MEMORY
from tests.test_preflight import write_config
from tests.test_teacher_vllm import SEQUENCES, assert_same_topk, reference_logprobs

SERVER_MAX_LOGPROBS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("remote") / "tiny"), seed=7, init_std=0.1)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("remote_log") / "server.log")
    # the stock vLLM server (the packed route of opkd's own: tests/test_teacher_score_server.py)
    cfg = TeacherServerConfig(model=model_dir, k=SERVER_MAX_LOGPROBS, port=free_port(),
                              scoring="prompt_logprobs", dtype="float32", max_model_len=64,
                              served_model_name="teacher",
                              extra_args=[f"--gpu-memory-utilization={ENGINE_MEMORY}"])
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


@pytest.mark.vllm
def test_remote_topk_matches_transformers_over_concurrent_batches(server, model_dir):
    teacher = client(server, batch_size=2, max_concurrency=2)
    sequences = SEQUENCES + [s[::-1] for s in SEQUENCES]  # 6 sequences -> 3 requests
    scored = teacher.score(sequences)
    assert teacher.stats["requests"] == 3 and teacher.stats["retries"] == 0
    for seq, rows in zip(sequences, scored):
        assert_same_topk(rows, reference_logprobs(model_dir, seq), 8)


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_real_server_refuses_a_student_with_a_larger_vocabulary(server, model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    client(server, student_vocab_size=vocab).check_server()  # the same vocabulary: accepted
    with pytest.raises(TeacherError, match=rf"{server.url}: its vocabulary has {vocab} token ids, "
                                           rf"the student's has {vocab + 44}"):
        client(server, student_vocab_size=vocab + 44).check_server()


@pytest.mark.vllm
def test_start_up_probe_reads_a_real_servers_limits(server, model_dir, tmp_path, monkeypatch):
    """`opkd train`'s start-up check against vLLM itself (max_model_len 64, --max-logprobs 16): its
    listing and its refusal are read as the fake servers of tests/test_preflight_servers.py send them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(top_k: int, max_model_len: int):
        teacher = {"backend": "remote", "url": server.url, "top_k": top_k}
        path = write_config(tmp_path, {"student": model_dir}, f"rollout.max_model_len={max_model_len}",
                            teacher=teacher)
        preflight(load_config(path))

    run(SERVER_MAX_LOGPROBS, 63)  # a 63-token sequence and the generated position fill the 64
    with pytest.raises(PreflightError, match=rf"^teacher.teachers.0.top_k: teacher.k=17: teacher server "
                                             rf"{server.url} allows at most {SERVER_MAX_LOGPROBS} logprobs"):
        run(SERVER_MAX_LOGPROBS + 1, 63)
    with pytest.raises(PreflightError, match=rf"^teacher.teachers.0.url: teacher server {server.url} serves "
                                             r"'teacher' with max_model_len 64; .* needs 65"):
        run(8, 64)


@pytest.mark.vllm
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


# ---- a fake server: what a stock vLLM server answers, with a vocabulary of our choosing ---------------

def _fake_prompt_logprobs(seq: list[int], k: int) -> list:
    """`[null, {id: {logprob, rank}}...]`: ids 0..k-1 ranked in order, plus the actual next token."""
    out = [None]
    for tok in seq[1:]:
        row = {str(i): {"logprob": math.log(0.5 ** (i + 1)), "rank": i + 1, "decoded_token": "x"}
               for i in range(k)}
        row.setdefault(str(tok), {"logprob": -30.0, "rank": k + 7, "decoded_token": "y"})
        out.append(row)
    return out


def _fake_handler(vocab_size: int, bodies: list, cut_posts: bool = False):
    class FakeVllmHandlerForTest(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output quiet
            pass

        def _send(self, code: int, payload: dict) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if cut_posts and self.command == "POST":  # a server that dies while answering
                self.wfile.write(raw[:len(raw) // 2])
                self.close_connection = True
                return
            self.wfile.write(raw)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "fake-teacher", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            bad = [t for seq in body["prompt"] for t in seq if not 0 <= t < vocab_size]
            if bad:  # vLLM's renderer: VLLMValidationError -> HTTP 400
                self._send(400, {"error": {"message": f"Token id {max(bad)} is out of vocabulary",
                                           "type": "BadRequestError", "param": "prompt", "code": 400}})
                return
            k = body.get("prompt_logprobs") or 0
            choices = [{"index": i, "text": "x",
                        "prompt_logprobs": _fake_prompt_logprobs(seq, k) if k else None}
                       for i, seq in enumerate(body["prompt"])]
            self._send(200, {"id": "cmpl-fake", "object": "text_completion", "choices": choices})

    return FakeVllmHandlerForTest


@contextmanager
def fake_server(vocab_size: int, cut_posts: bool = False):
    bodies: list = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _fake_handler(vocab_size, bodies, cut_posts))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", bodies
    finally:
        httpd.shutdown()
        httpd.server_close()


def _vocab_probes(bodies: list) -> list:
    return [b["prompt"] for b in bodies if "prompt_logprobs" not in b]


def test_student_vocabulary_larger_than_the_servers_is_refused_naming_both_sizes():
    with fake_server(vocab_size=100) as (url, bodies):
        teacher = RemoteVllmTeacher(RemoteTeacherConfig(url=url, k=4, student_vocab_size=120, max_retries=0))
        with pytest.raises(TeacherError,
                           match=rf"{url}: its vocabulary has 100 token ids, the student's has 120"):
            teacher.score([[1, 2, 3]])
    assert teacher.stats["requests"] == 0  # nothing was scored
    assert _vocab_probes(bodies)[0] == [[119]]  # the student's largest id first


def test_matching_vocabulary_is_accepted_after_one_probe():
    with fake_server(vocab_size=100) as (url, bodies):
        teacher = RemoteVllmTeacher(RemoteTeacherConfig(url=url, k=4, student_vocab_size=100))
        scored = teacher.score([[1, 2, 3], [99, 5]])
        teacher.score([[4, 5, 6]])
    assert [tuple(s.ids.shape) for s in scored] == [(2, 4), (1, 4)]
    assert _vocab_probes(bodies) == [[[99]]]  # asked once, not per request


def test_answer_cut_short_is_retried_then_names_the_server():
    """A server that dies while sending its answer (the client reads fewer bytes than announced)
    is a connection failure: bounded retries, then the error that names the server."""
    with fake_server(vocab_size=100, cut_posts=True) as (url, bodies):
        teacher = RemoteVllmTeacher(RemoteTeacherConfig(url=url, k=4, max_retries=2, backoff_s=0.01))
        with pytest.raises(TeacherUnavailableError, match=rf"teacher server {url} did not answer .* "
                                                          r"after 3 attempts: IncompleteRead"):
            teacher.score([[1, 2, 3]])
    assert len(bodies) == 3 and teacher.stats["retries"] == 2


def test_unchecked_vocabulary_says_so(caplog):
    with fake_server(vocab_size=100) as (url, _):
        teacher = RemoteVllmTeacher(RemoteTeacherConfig(url=url, k=4))
        with caplog.at_level(logging.WARNING, logger="opkd_mcore.teacher.remote"):
            teacher.check_server()
    assert f"teacher server {url}: student_vocab_size not given" in caplog.text
