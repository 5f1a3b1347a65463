"""`opkd teacher-serve --scoring device`: the packed top-k route, its wire format and its client.

Fast tests serve a deterministic scorer (`topk_logprobs` over a fixed random embedding and output
weight) through the real HTTP server and client, so that the rows the client builds can be compared
bit for bit with the scorer's own; (`-m vllm`) the server process `opkd teacher-serve` starts, with a
real vLLM CPU engine, against `transformers`' float64 top-k.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, MalformedTeacherOutputError, TopKTeacher
from opkd_mcore.teacher.base import TeacherError, TeacherUnavailableError
from opkd_mcore.teacher.device_topk import topk_logprobs
from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher
from opkd_mcore.teacher.score_server import TopKScoreServer
from opkd_mcore.teacher.serve import TeacherServerConfig, server_command
from opkd_mcore.teacher.topk_wire import (
    RequestError,
    decode_topk_response,
    encode_topk_response,
    parse_request,
)

VOCAB, HIDDEN = 50, 12
_gen = torch.Generator().manual_seed(3)
EMBED, WEIGHT = torch.randn(VOCAB, HIDDEN, generator=_gen), torch.randn(VOCAB, HIDDEN, generator=_gen)
SEQS = [[1, 4, 5, 6, 7], [1, 10, 11], [1, 3, 3, 3, 12, 4, 2], [2, 49], [5, 6, 7, 8], [9, 9, 9]]


def score_fn(seqs, k, temperature):
    """A stand-in for the engine: rows of `log_softmax(E[t] W^T / T)` for every position t."""
    out = []
    for seq in seqs:
        logprobs, ids = topk_logprobs(EMBED[seq[:-1]], WEIGHT, k=k, temperature=temperature)
        out.append(TopKTeacher(ids=ids, logprobs=logprobs))
    return out


@contextmanager
def serving(fn=score_fn, max_model_len=16):
    server = TopKScoreServer(fn, vocab_size=VOCAB, name="fake-teacher", max_model_len=max_model_len, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()


def client(url, **kw):
    return RemoteVllmTeacher(RemoteTeacherConfig(**{"url": url, "k": 6, "max_retries": 0, **kw}))


@pytest.mark.parametrize("k, temperature", [(6, 1.0), (60, 0.7)])
def test_client_rows_are_the_servers_bit_for_bit(k, temperature):
    """`scoring: auto` finds the packed route; rows (a k above the vocabulary included: padded) arrive
    exactly as the scorer made them, over concurrent batches."""
    with serving() as server:
        scoring = "device" if temperature != 1 else "auto"  # a temperature needs the route named
        teacher = client(server.url, k=k, temperature=temperature, scoring=scoring, batch_size=2,
                         max_concurrency=3, student_vocab_size=VOCAB)
        got = teacher.score(SEQS)
    assert teacher.scoring == "device" and teacher.stats["requests"] == 1 + 3  # the probe, 3 batches
    for g, w in zip(got, score_fn(SEQS, k, temperature)):
        assert torch.equal(g.ids, w.ids) and torch.equal(g.logprobs, w.logprobs)
    if k > VOCAB:
        assert (got[0].ids[:, VOCAB:] == PAD_ID).all()


def test_requests_queued_while_the_engine_works_are_scored_in_one_call():
    calls = []

    def slow(seqs, k, temperature):
        calls.append(len(seqs))
        time.sleep(0.5 if len(calls) == 1 else 0)
        return score_fn(seqs, k, temperature)

    with serving(slow) as server:
        teacher = client(server.url, batch_size=1, max_concurrency=6)
        teacher.score(SEQS)
    # the probe's call, then the 6 one-sequence requests: the first alone, those queued behind it together
    assert calls[0] == 1 and sum(calls[1:]) == len(SEQS) and len(calls) < 1 + len(SEQS), calls


def test_a_student_vocabulary_larger_than_the_routes_is_refused_naming_both():
    with serving() as server:
        with pytest.raises(TeacherError, match=rf"vocabulary has {VOCAB} token ids, the student's has 70"):
            client(server.url, student_vocab_size=70).check_server()


def test_scoring_device_against_a_server_without_the_route_names_it():
    from tests.test_teacher_remote import fake_server

    with fake_server(vocab_size=100) as (url, _):
        with pytest.raises(TeacherError, match=rf"teacher server {url} has no top-k route /opkd/v1/topk"):
            client(url, scoring="device").check_server()
        stock = client(url)  # auto: the OpenAI route of a stock server
        stock.check_server()
        assert stock.scoring == "prompt_logprobs"


def test_a_sequence_longer_than_the_engine_is_refused_by_the_server():
    with serving(max_model_len=4) as server:
        with pytest.raises(TeacherError, match=r"rejected request 1 .*HTTP 400.*sequences\[1\]: expected "
                                               r"2\.\.4 integer token ids, got 5"):
            client(server.url).score([[1, 2], [1, 2, 3, 4, 5]])


def test_an_engine_failure_is_http_500_retried_then_named():
    def broken(seqs, k, temperature):
        if len(seqs) > 1:
            raise RuntimeError("engine died")
        return score_fn(seqs, k, temperature)

    with serving(broken) as server:
        with pytest.raises(TeacherUnavailableError,
                           match=rf"{server.url} did not answer .* after 2 attempts.*engine died"):
            client(server.url, max_retries=1, backoff_s=0.01).score(SEQS[:2])


@pytest.mark.parametrize("payload, match", [
    ([1, 2], "expected a JSON object"),
    ({"sequences": [[1, 2]], "k": 0}, "k: expected an integer >= 1"),
    ({"sequences": [[1, 2]], "k": 2, "temperature": 0}, "temperature: expected a number > 0"),
    ({"sequences": [], "k": 2}, "sequences: expected a non-empty list"),
    ({"sequences": [[1, 2], [3]], "k": 2}, r"sequences\[1\]: expected 2\.\.8 integer token ids, got 1"),
    ({"sequences": [[1, 2.5]], "k": 2}, r"sequences\[0\]: expected 2\.\.8 integer"),
    ({"sequences": [[1, 50]], "k": 2}, r"sequences\[0\]: Token id 50 is out of vocabulary"),
])
def test_bad_requests_name_the_field(payload, match):
    with pytest.raises(RequestError, match=match):
        parse_request(payload, VOCAB, 8)


def test_responses_of_another_shape_are_refused_naming_the_request():
    rows = score_fn(SEQS[:2], 3, 1.0)
    body = encode_topk_response(rows)
    assert len(body) == 16 + 4 * 2 + 8 * 3 * (4 + 2)  # header, counts, float32 + int32 rows
    decode_topk_response(body, SEQS[:2], 3, VOCAB, "req 9")
    for bad, match in [(b"XXXXXXXX" + body[8:], "rows of 2 sequences at k=3, got b'XXXXXXXX'"),
                       (body, "at k=4, got b'OPKDTK01', 2 sequences, k=3"),
                       (body[:-4], r"expected \[4, 2\] rows")]:
        with pytest.raises(MalformedTeacherOutputError, match=f"req 9: .*{match}"):
            decode_topk_response(bad, SEQS[:2], 4 if bad is body else 3, VOCAB, "req 9")
    with pytest.raises(MalformedTeacherOutputError,
                       match=r"req 9, sequence 0, position 3: expected ids in \[0, 40\)"):
        decode_topk_response(body, SEQS[:2], 3, 40, "req 9")


def test_serve_runs_the_device_server_for_a_plain_checkpoint(tmp_path):
    from opkd_mcore.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(str(tmp_path / "tiny"), seed=1)
    out = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", "teacher-serve", "--model", model, "--port",
                          "8124", "--max-model-len", "64", "--gpu-memory-utilization", "0.2", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    assert cmd[1:3] == ["-m", "opkd_mcore.teacher.score_server"]
    assert cmd[cmd.index("--port") + 1] == "8124" and cmd[cmd.index("--max-model-len") + 1] == "64"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.2"
    for stock in (TeacherServerConfig(model=model, scoring="prompt_logprobs"),
                  TeacherServerConfig(model=model, extra_args=["--max-num-seqs", "4"])):  # auto: vLLM's flags
        assert server_command(stock)[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    with pytest.raises(ValueError, match=r"extra_args: \['--max-num-seqs', '4'\] are vLLM server flags"):
        server_command(TeacherServerConfig(model=model, scoring="device", extra_args=["--max-num-seqs", "4"]))


# ---------------------------------------------------------------- the real server (vLLM CPU engine)
@pytest.mark.vllm
def test_teacher_serve_device_rows_match_transformers(tmp_path):
    from opkd_mcore.models.tiny import save_tiny_hf_model
    from opkd_mcore.teacher.serve import TeacherServer
    from tests._dist import free_port
    from tests.conftest import ENGINE_MEMORY
    from tests.test_teacher_vllm import SEQUENCES, assert_same_topk, reference_logprobs

    model = save_tiny_hf_model(str(tmp_path / "tiny"), seed=7, init_std=0.1)
    cfg = TeacherServerConfig(model=model, port=free_port(), dtype="float32", max_model_len=32,
                              gpu_memory_utilization=ENGINE_MEMORY)
    log = str(tmp_path / "server.log")
    full = [1] + [3 + (i * 5) % 11 for i in range(31)]  # fills the engine's context
    with TeacherServer(cfg, log_path=log, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
        try:
            server.wait_ready(timeout_s=900)
        except Exception:
            with open(log) as f:
                pytest.fail(f"teacher server did not start:\n{f.read()[-3000:]}")
        for temperature in (1.0, 0.6):
            teacher = client(server.url, k=8, temperature=temperature, scoring="device", batch_size=2)
            for seq, rows in zip([*SEQUENCES, full], teacher.score([*SEQUENCES, full])):
                assert_same_topk(rows, reference_logprobs(model, seq, temperature), 8)
