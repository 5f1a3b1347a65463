"""Remote teacher servers before a run starts: URLs are checked in full at config time, and each server
is asked once at start-up (its model, context length, vocabulary and max-logprobs) by a local HTTP
server that answers as vLLM's OpenAI server does; every failure names the key and the address."""
from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from opkd_mcore import launch
from opkd_mcore.config import ConfigError, load_config
from opkd_mcore.teacher.base import TeacherError
from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher
from opkd_mcore.train import preflight as preflight_module
from opkd_mcore.train.preflight import PreflightError, preflight
from tests._hf_config import hf_checkpoint
from tests.test_preflight import no_engines, write_config  # noqa: F401  (no_engines: autouse fixture)

VOCAB = 256  # the tiny student's vocab_size


# ---- URLs at config time ------------------------------------------------------------------------------

@pytest.mark.parametrize("url, fragment", [
    ("http://teacher:abc", "the port 'abc' of host 'teacher' is not a number in 1-65535"),
    ("http://teacher:70000", "the port '70000'"),
    ("http://teacher:0", "the port '0'"),
    ("http://teacher:", "the port ''"),
    ("http://teacher:+80", "the port '+80'"),
    ("http://teacher:8000/v1", "without /v1"),
    ("http://teacher:8000/v1/", "without /v1"),
    ("http://teacher:8000/?model=x", "query or fragment"),
    ("http://user:secret@teacher:8000", "credentials"),
    ("http://:8000", "names no host"),
    ("http://bad host:8000", "spaces"),
    ("http://[::1:8000", "not a URL"),
    ("teacher:8000", "scheme http or https"),
    ("ftp://teacher:21", "scheme http or https, got 'ftp'"),
])
def test_bad_urls_are_refused_at_config_time_by_key(tmp_path, models, url, fragment):
    teacher = {"backend": "remote", "url": "http://127.0.0.1:8000", "replica_urls": [url], "top_k": 8}
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, models, teacher=teacher))
    assert str(err.value).startswith("teacher.teachers.0.replica_urls.0: "), err.value
    assert fragment in str(err.value) and "base URL" in str(err.value) and repr(url) in str(err.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://teacher.example.com", "http://teacher:1/",
                                 "http://[::1]:65535", "http://node-3.cluster:8000/proxy/teacher/"])
def test_good_urls_are_accepted(tmp_path, models, url):
    teacher = {"backend": "remote", "url": url, "top_k": 8}
    assert load_config(write_config(tmp_path, models, teacher=teacher)).teacher.teachers[0].url == url


def test_a_client_given_a_bad_port_fails_at_once_without_retries():
    teacher = RemoteVllmTeacher(RemoteTeacherConfig(url="http://127.0.0.1:abc", k=4, max_retries=3,
                                                    backoff_s=5.0))
    start = time.monotonic()
    with pytest.raises(TeacherError, match=r"http://127.0.0.1:abc: not a usable address"):
        teacher.check_server()
    assert time.monotonic() - start < 2.0 and teacher.stats["retries"] == 0


# ---- a server that answers as vLLM's OpenAI server --------------------------------------------------

def _handler(server: dict):
    class VllmLikeHandlerForTest(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output quiet
            pass

        def _send(self, code: int, payload: dict) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _refuse(self, message: str, param: str) -> None:  # vLLM's VLLMValidationError -> HTTP 400
            self._send(400, {"error": {"message": message, "type": "BadRequestError", "param": param,
                                       "code": 400}})

        def do_GET(self):
            server["requests"].append(("GET", self.path, None))
            if self.path != "/v1/models":  # FastAPI's answer to a route it does not have
                return self._send(404, {"detail": "Not Found"})
            models = [{"id": name, "object": "model", "owned_by": "vllm",
                       "max_model_len": server["max_model_len"]} for name in server["models"]]
            self._send(200, {"object": "list", "data": models})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server["requests"].append(("POST", self.path, body))
            bad = [t for seq in body["prompt"] for t in seq if not 0 <= t < server["vocab"]]
            if bad:
                return self._refuse(f"Token id {max(bad)} is out of vocabulary", "prompt")
            k = body.get("prompt_logprobs") or 0
            if k > server["max_logprobs"]:
                return self._refuse(f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                                    f"{server['max_logprobs']}", "prompt_logprobs")
            row = {str(j): {"logprob": -1.0 - j, "rank": j + 1} for j in range(k)}
            choices = [{"index": i, "text": "x", "prompt_logprobs": [None] + [row] * (len(seq) - 1)}
                       for i, seq in enumerate(body["prompt"])]
            self._send(200, {"id": "cmpl-test", "object": "text_completion", "choices": choices})

    return VllmLikeHandlerForTest


@contextmanager
def vllm_like_server(*, vocab: int = VOCAB, max_logprobs: int = 20, max_model_len: int = 512,
                     models: tuple[str, ...] = ("teacher",)):
    state = dict(vocab=vocab, max_logprobs=max_logprobs, max_model_len=max_model_len, models=list(models),
                 requests=[])
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}"
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def closed_port_url() -> str:
    """An address where nothing listens (the port was just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"student": hf_checkpoint(root, "student")}


def _remote_config(tmp_path, models, url: str, replicas=()):
    teacher = {"backend": "remote", "url": url, "replica_urls": list(replicas), "top_k": 8}
    return load_config(write_config(tmp_path, models, teacher=teacher))


def _probe_errors(cfg) -> list[str]:
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    return err.value.errors


def test_a_healthy_server_passes_with_four_requests(tmp_path, models):
    """The listing, the packed top-k route (`scoring: auto`; a stock server has none), then the
    vocabulary and max-logprobs probes of the OpenAI route."""
    with vllm_like_server() as server:
        preflight(_remote_config(tmp_path, models, server["url"]))
    methods = [(method, path) for method, path, _ in server["requests"]]
    assert methods == [("GET", "/v1/models"), ("GET", "/opkd/v1/topk"), ("POST", "/v1/completions"),
                       ("POST", "/v1/completions")]
    vocab_probe, logprobs_probe = (body for _, _, body in server["requests"][2:])
    assert vocab_probe["prompt"] == [[VOCAB - 1]] and vocab_probe["model"] == "teacher"
    assert logprobs_probe["prompt_logprobs"] == 8


def test_top_k_above_the_servers_max_logprobs_is_refused_by_key(tmp_path, models):
    with vllm_like_server(max_logprobs=4) as server:
        (line,) = _probe_errors(_remote_config(tmp_path, models, server["url"]))
    assert line.startswith(f"teacher.teachers.0.top_k: teacher.k=8: teacher server {server['url']} allows at "
                           "most 4 logprobs (--max-logprobs)")


def test_a_server_context_shorter_than_the_rollouts_is_refused(tmp_path, models):
    """A top-k teacher scores the whole sequence as a prompt and vLLM keeps a position for the one token
    it generates: a 256-token rollout needs a 257-token server."""
    with vllm_like_server(max_model_len=256) as server:
        (line,) = _probe_errors(_remote_config(tmp_path, models, server["url"]))
        assert line == (f"teacher.teachers.0.url: teacher server {server['url']} serves 'teacher' with "
                        "max_model_len 256; scoring the rollout's longest sequences (rollout.max_model_len = "
                        "256) needs 257 (restart it with --max-model-len 257)")
    with vllm_like_server(max_model_len=257) as server:
        preflight(_remote_config(tmp_path, models, server["url"]))


def test_a_server_with_a_smaller_vocabulary_is_refused(tmp_path, models):
    with vllm_like_server(vocab=200) as server:
        (line,) = _probe_errors(_remote_config(tmp_path, models, server["url"]))
    assert line.startswith(f"teacher.teachers.0.url: teacher server {server['url']}: its vocabulary has 200 "
                           f"token ids, the student's has {VOCAB}")


def test_a_server_that_lists_no_model_is_refused(tmp_path, models):
    with vllm_like_server(models=()) as server:
        (line,) = _probe_errors(_remote_config(tmp_path, models, server["url"]))
    assert line.startswith(f"teacher.teachers.0.url: teacher server {server['url']}: /v1/models lists no "
                           "served model")


def test_unreachable_servers_are_each_named_by_key_after_one_attempt(tmp_path, models):
    dead_url, dead_replica = closed_port_url(), closed_port_url()
    with vllm_like_server() as server:
        cfg = _remote_config(tmp_path, models, dead_url, replicas=[server["url"], dead_replica])
        start = time.monotonic()
        errors = _probe_errors(cfg)
    assert time.monotonic() - start < 10.0  # no retries with backoff
    assert [e.split(": ")[0] for e in errors] == ["teacher.teachers.0.url",
                                                  "teacher.teachers.0.replica_urls.1"]
    assert f"teacher server {dead_url} did not answer the model listing after 1 attempts" in errors[0]
    assert dead_replica in errors[1]


def test_check_probes_the_servers_and_exits_2_naming_the_address(tmp_path, models, capsys, monkeypatch):
    monkeypatch.setattr(preflight_module, "PROBE_TIMEOUT_S", 5.0)
    with vllm_like_server(max_logprobs=4) as server:
        teacher = {"backend": "remote", "url": server["url"], "top_k": 8}
        path = write_config(tmp_path, models, teacher=teacher)
        assert launch.main(["--check", "--config", path]) == 2
        err = capsys.readouterr().err
        assert f"error: teacher.teachers.0.top_k: teacher.k=8: teacher server {server['url']}" in err
        assert launch.main(["--check", "--config", path, "teacher.teachers.0.top_k=4", "loss.k=null"]) == 0
