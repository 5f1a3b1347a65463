"""Client of a teacher server: a stock vLLM OpenAI server used as a top-k teacher (`/v1/completions`),
opkd's device-scoring server (`opkd teacher-serve --scoring device`: packed top-k tensors from
`/opkd/v1/topk`, `teacher/topk_wire.py`), or with `output="hidden"` a hidden-state teacher
(`/pooling`, raw bf16 bytes: `teacher/hidden_states.py`).

`scoring`: `device` uses the packed route and refuses a server without it; `prompt_logprobs` the
OpenAI route; `auto` asks the server once (`GET /opkd/v1/topk`) and uses the packed route where it
answers.

On the OpenAI route, requests carry token-id prompts (the server must use the student's tokenizer, or
across tokenizers (`loss.cross_tokenizer`) the tokenizer the trainer re-tokenizes with for the teacher)
with `prompt_logprobs=k` and `max_tokens=1`; the server must run with prefix caching off, or cached
positions come back without logprobs (`opkd teacher-serve` starts it that way). A server's prompt
logprobs are at temperature 1 and cannot be re-tempered from k entries, so a teacher temperature
other than 1 is refused there rather than silently ignored (the packed route takes it).

Before the first request the client checks, once per server, that the server takes every token id the
student can emit (across tokenizers: every id of the teacher's tokenizer). A stock vLLM server says
nothing about its vocabulary size without extra flags (`/tokenizer_info` needs
`--enable-tokenizer-info-endpoint` and lists no size), but it refuses a prompt id past its vocabulary
with HTTP 400 "Token id N is out of vocabulary" (the packed route answers the same way). So one
1-token prompt with the largest id answers the question; only when it is refused does a bisection
over ids find the server's size, for the error message.
"""
from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from opkd_mcore.config.schema import TEACHER_SCORINGS
from opkd_mcore.losses.teacher_outputs import HiddenTeacher, TopKTeacher
from opkd_mcore.teacher.base import (
    MalformedTeacherOutputError,
    Teacher,
    TeacherError,
    TeacherUnavailableError,
    check_outputs,
    check_sequences,
    topk_from_ranked,
)
from opkd_mcore.teacher.hidden_states import (
    POOLING_TASK,
    WIRE_DTYPE,
    decode_bytes_response,
    pooled_input,
    rows_from_states,
)
from opkd_mcore.teacher.topk_wire import MAGIC, TOPK_ROUTE, decode_topk_response

logger = logging.getLogger(__name__)
_MAX_ALLOWED = re.compile(r"max(?:imum)? allowed:?\s*(\d+)", re.IGNORECASE)
_OUT_OF_VOCAB = re.compile(r"out of vocabulary", re.IGNORECASE)


@dataclass(kw_only=True)
class RemoteTeacherConfig:
    """How to reach and use one teacher server."""

    url: str = "http://127.0.0.1:8000"  # server base URL (no /v1)
    k: int = 20  # top-k per position; must be <= the server's --max-logprobs
    model: str | None = None  # served model name; None = the first one /v1/models lists
    temperature: float = 1.0  # teacher temperature; != 1 needs scoring "device" (see module docstring)
    batch_size: int = 8  # sequences per HTTP request
    max_concurrency: int = 4  # HTTP requests in flight per client
    timeout_s: float = 120.0  # per HTTP request
    max_retries: int = 3  # extra attempts after a connection error / timeout / HTTP 5xx
    backoff_s: float = 0.5  # first retry delay; doubles per attempt
    backoff_max_s: float = 8.0  # cap of the retry delay
    student_vocab_size: int | None = None  # ids the student can emit (its HF vocab_size); the server
    # must accept all of them (checked once); None skips the check with a warning
    tokenizer_of: str = "student"  # whose tokenizer writes the ids sent: student | teacher (across
    # tokenizers the trainer re-tokenizes for the teacher; student_vocab_size is then the teacher's size)
    output: str = "topk"  # topk: top-k rows | hidden: final-norm hidden states (--output hidden servers)
    scoring: str = "auto"  # top-k rows by: device (opkd's packed route) | prompt_logprobs (OpenAI) | auto

    def validate(self) -> None:
        if self.output not in ("topk", "hidden"):
            raise ValueError(f"teacher.output: expected 'topk' or 'hidden', got {self.output!r}")
        if self.scoring not in TEACHER_SCORINGS:
            raise ValueError(f"teacher.scoring: expected one of {TEACHER_SCORINGS}, got {self.scoring!r}")
        if self.tokenizer_of not in ("student", "teacher"):
            raise ValueError(f"tokenizer_of: expected 'student' or 'teacher', got {self.tokenizer_of!r}")
        if self.output == "hidden" and self.scoring != "auto":
            raise ValueError(f"teacher.scoring: {self.scoring!r} chooses how top-k rows are computed; a "
                             "teacher with output 'hidden' sends hidden states (leave it 'auto')")
        if self.temperature != 1.0 and self.scoring != "device":
            raise ValueError(f"teacher.temperature: a server's prompt logprobs are at temperature 1 and "
                             f"cannot honour {self.temperature}; use 1.0, scoring 'device' (opkd "
                             "teacher-serve --scoring device) or an in-process / Megatron teacher")
        for name in ("k", "batch_size", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"teacher.{name}: expected >= 1, got {getattr(self, name)}")
        if self.student_vocab_size is not None and self.student_vocab_size < 1:
            raise ValueError(f"teacher.student_vocab_size: expected >= 1, got {self.student_vocab_size}")
        if self.max_retries < 0 or self.timeout_s <= 0:
            raise ValueError("teacher.max_retries must be >= 0 and teacher.timeout_s > 0, got "
                             f"{self.max_retries} and {self.timeout_s}")


class MaxLogprobsError(ValueError):
    """The server allows fewer prompt logprobs (`--max-logprobs`) than the client's `k`."""


class _HttpStatusError(Exception):
    def __init__(self, code: int, body: str):
        super().__init__(f"HTTP {code}: {body[:500]}")
        self.code, self.body = code, body


def parse_completion_response(payload: dict, sequences: Sequence[Sequence[int]], k: int,
                              request: str) -> list[TopKTeacher]:
    """`/v1/completions` JSON with prompt logprobs -> one `TopKTeacher` per sequence.

    `choices[i].prompt_logprobs` is `[null, {"<id>": {"logprob", "rank", ...}}, ...]`, one entry
    per prompt token. Wrong counts, NaN or bad ids raise MalformedTeacherOutputError naming `request`.
    """
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or len(choices) != len(sequences):
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise MalformedTeacherOutputError(f"{request}: expected {len(sequences)} choices, got {got}")
    by_index = sorted(choices, key=lambda c: c.get("index", 0))
    out = []
    for j, (seq, choice) in enumerate(zip(sequences, by_index)):
        where = f"{request}, sequence {j}"
        positions = choice.get("prompt_logprobs")
        if not isinstance(positions, list) or len(positions) != len(seq):
            got = len(positions) if isinstance(positions, list) else positions
            raise MalformedTeacherOutputError(
                f"{where}: expected {len(seq)} prompt_logprobs entries, got {got}")
        try:
            rows = [[(int(tok), float(e["logprob"]), int(e["rank"])) for tok, e in pos.items()]
                    for pos in positions[1:]]
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise MalformedTeacherOutputError(f"{where}: unreadable prompt_logprobs ({err!r})") from err
        out.append(topk_from_ranked(rows, k, request=where))
    return out


class RemoteVllmTeacher(Teacher):
    """Scores sequences on a vLLM OpenAI server: batched, concurrent, with retries and timeouts."""

    def __init__(self, cfg: RemoteTeacherConfig):
        cfg.validate()
        self.cfg = cfg
        self.url = cfg.url.rstrip("/")
        self._model = cfg.model
        self._checked = False
        self.scoring: str | None = None  # hidden | device | prompt_logprobs, once check_server has run
        self._server_vocab: int | None = None  # the packed route's vocabulary
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()  # apart from _lock, which check_server holds across calls
        self._counter = 0
        # wire_bytes: response bodies received (what a scored token costs on the network)
        self.stats = {"requests": 0, "retries": 0, "tokens": 0, "http_s": 0.0, "json_decode_s": 0.0,
                      "parse_s": 0.0, "wire_bytes": 0}

    @property
    def address(self) -> str:
        return self.url

    def _add_stats(self, **deltas) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self.stats[key] += value

    # ---- HTTP ------------------------------------------------------------------------------

    def _http(self, path: str, body: dict | None) -> bytes:
        return self._request(path, body)[0]

    def _request(self, path: str, body: dict | None) -> tuple[bytes, object]:
        """(response body, response headers)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                return resp.read(), resp.headers
        except urllib.error.HTTPError as err:
            raise _HttpStatusError(err.code, err.read().decode(errors="replace")) from err

    def _call(self, path: str, body: dict | None, request: str, raw: bool = False):
        """POST/GET with bounded retries on connection errors (an answer cut short included),
        timeouts and 5xx; 4xx is final.
        JSON by default; `raw`: (body bytes, the `metadata` header) of a bytes response."""
        last = None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self._add_stats(retries=1)
                time.sleep(min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.backoff_max_s))
            try:
                t0 = time.perf_counter()
                data, headers = self._request(path, body)
                t1 = time.perf_counter()
                if raw:
                    self._add_stats(http_s=t1 - t0, wire_bytes=len(data))
                    return data, headers.get("metadata", "")
                payload = json.loads(data)
                self._add_stats(http_s=t1 - t0, json_decode_s=time.perf_counter() - t1,
                                wire_bytes=len(data))
                return payload
            except _HttpStatusError as err:
                if err.code < 500:
                    raise TeacherError(f"teacher server {self.url} rejected {request}: {err}") from err
                last = err
            except http.client.InvalidURL as err:  # e.g. a port that is not a number: no retry helps
                raise TeacherError(f"teacher server {self.url}: not a usable address ({err})") from err
            # URLError is an OSError; an answer cut short (the server died while sending it) is an
            # http.client.IncompleteRead, an HTTPException
            except (OSError, TimeoutError, http.client.HTTPException, json.JSONDecodeError) as err:
                last = err
            logger.warning("teacher server %s, %s: attempt %d/%d failed: %r", self.url, request,
                           attempt + 1, self.cfg.max_retries + 1, last)
        raise TeacherUnavailableError(
            f"teacher server {self.url} did not answer {request} after "
            f"{self.cfg.max_retries + 1} attempts: {last!r}", self.url)

    # ---- checks before scoring -------------------------------------------------------------

    def check_server(self) -> None:
        """Resolve the model name and how the server scores, and make sure it can (once): it takes
        k prompt logprobs, or answers its packed top-k route, or its hidden-state route."""
        with self._lock:
            if self._checked:
                return
            if self._model is None:
                self._served_model()
            self.scoring = self._server_scoring()
            self._check_vocabulary()
            if self.scoring == "hidden":   # no logprobs involved: one small request proves the mode
                self._score_hidden_batch([[0, 0]], "the hidden-state probe")
            elif self.scoring == "device":
                self._score_device_batch([[0, 0]], "the top-k route probe")
            else:
                self._check_max_logprobs()
            self._checked = True

    def _check_max_logprobs(self) -> None:
        probe = {"model": self._model, "prompt": [[0, 0]], "max_tokens": 1, "prompt_logprobs": self.cfg.k}
        try:
            self._call("/v1/completions", probe, "the max-logprobs probe")
        except TeacherError as err:
            allowed = _MAX_ALLOWED.search(str(err))
            if allowed is None:
                raise
            raise MaxLogprobsError(
                f"teacher.k={self.cfg.k}: teacher server {self.url} allows at most "
                f"{allowed.group(1)} logprobs (--max-logprobs); restart it with "
                f"--max-logprobs >= {self.cfg.k} (opkd teacher-serve --k {self.cfg.k})") from err

    def _server_scoring(self) -> str:
        """hidden | device | prompt_logprobs: the configured way, `auto` resolved by asking the server."""
        if self.cfg.output == "hidden" or self.cfg.scoring == "prompt_logprobs":
            return "hidden" if self.cfg.output == "hidden" else "prompt_logprobs"
        try:
            info = self._call(TOPK_ROUTE, None, "the top-k route probe")
        except TeacherError as err:  # a stock vLLM server: 404
            if not (isinstance(err.__cause__, _HttpStatusError) and err.__cause__.code in (404, 405)):
                raise
            info = None
        if isinstance(info, dict) and info.get("format") == MAGIC.decode() and \
                isinstance(info.get("vocab_size"), int):
            self._server_vocab = info["vocab_size"]
            return "device"
        if self.cfg.scoring == "device":
            raise TeacherError(f"teacher server {self.url} has no top-k route {TOPK_ROUTE} (a stock vLLM "
                               "server?): start it with `opkd teacher-serve --scoring device`, or set "
                               "scoring: prompt_logprobs")
        return "prompt_logprobs"

    def served_model(self) -> dict:
        """The `/v1/models` entry of the model this client scores with (vLLM lists its `id` and
        `max_model_len`): the configured `model`, or the first one listed, which it then keeps."""
        with self._lock:
            return self._served_model()

    def _served_model(self) -> dict:
        listing = self._call("/v1/models", None, "the model listing")
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list):
            entries = []
        entries = [e for e in entries if isinstance(e, dict) and "id" in e]
        if not entries:
            raise TeacherError(f"teacher server {self.url}: /v1/models lists no served model "
                               f"(got {json.dumps(listing)[:300]})")
        ids = [e["id"] for e in entries]
        if self._model is None:
            self._model = ids[0]
        elif self._model not in ids:
            raise TeacherError(f"teacher server {self.url} serves {ids}, not the model {self._model!r}")
        return entries[ids.index(self._model)]

    def _accepts_token(self, token_id: int) -> bool:
        """Whether the server takes `token_id` in a prompt (vLLM: HTTP 400 "out of vocabulary")."""
        probe = {"model": self._model, "prompt": [[token_id]], "max_tokens": 1}
        path = "/v1/completions"
        if self.scoring == "hidden":
            probe, path = self._pooling_body([[token_id, token_id]]), "/pooling"  # sends [token_id]
        elif self.scoring == "device":
            probe, path = {"sequences": [[token_id, token_id]], "k": 1}, TOPK_ROUTE
        try:
            self._call(path, probe, f"the vocabulary probe (token id {token_id})",
                       raw=path != "/v1/completions")
        except TeacherError as err:
            if _OUT_OF_VOCAB.search(str(err)) is None:
                raise
            return False
        return True

    def _check_vocabulary(self) -> None:
        student = self.cfg.student_vocab_size
        if student is None:
            logger.warning("teacher server %s: student_vocab_size not given; not checking that the server "
                           "accepts every token id the student can emit", self.url)
            return
        if self._accepts_token(student - 1):
            return
        lo, hi = -1, student - 1  # bisection: the largest id known accepted, the smallest known refused
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._accepts_token(mid) else (lo, mid)
        if self.cfg.tokenizer_of == "teacher":
            raise TeacherError(
                f"teacher server {self.url}: its vocabulary has {hi} token ids, the teacher tokenizer the "
                f"trainer re-tokenizes with (teacher.teachers.0.model) has {student} (ids up to "
                f"{student - 1}, which the server refuses); serve the checkpoint whose tokenizer "
                "teacher.teachers.0.model holds, or point teacher.teachers.0.model at the served checkpoint")
        raise TeacherError(
            f"teacher server {self.url}: its vocabulary has {hi} token ids, the student's has {student} "
            f"(student samples may use ids up to {student - 1}, which the server refuses); serve a "
            "teacher with the student's tokenizer")

    # ---- scoring ---------------------------------------------------------------------------

    def _next_request_id(self) -> str:
        with self._lock:
            self._counter += 1
            return f"request {self._counter} to {self.url}"

    def _pooling_body(self, batch: list[list[int]]) -> dict:
        return {"model": self._model, "input": [pooled_input(s) for s in batch], "task": POOLING_TASK,
                "encoding_format": "bytes", "embed_dtype": WIRE_DTYPE, "add_special_tokens": False}

    def _score_hidden_batch(self, batch: list[list[int]], request: str) -> list[HiddenTeacher]:
        body, metadata = self._call("/pooling", self._pooling_body(batch), request, raw=True)
        t0 = time.perf_counter()
        states = decode_bytes_response(body, metadata, len(batch), request)
        rows = [rows_from_states(s, x, f"{request}, sequence {j}")
                for j, (s, x) in enumerate(zip(batch, states))]
        self._add_stats(parse_s=time.perf_counter() - t0, requests=1, tokens=sum(map(len, batch)))
        return rows

    def _score_device_batch(self, batch: list[list[int]], request: str) -> list[TopKTeacher]:
        body = {"sequences": batch, "k": self.cfg.k, "temperature": self.cfg.temperature}
        data, _ = self._call(TOPK_ROUTE, body, request, raw=True)
        t0 = time.perf_counter()
        rows = decode_topk_response(data, batch, self.cfg.k, self._server_vocab, request)
        self._add_stats(parse_s=time.perf_counter() - t0, requests=1, tokens=sum(map(len, batch)))
        return rows

    def _score_batch(self, batch: list[list[int]]) -> list[TopKTeacher] | list[HiddenTeacher]:
        request = self._next_request_id()
        if self.scoring == "hidden":
            return self._score_hidden_batch(batch, request)
        if self.scoring == "device":
            return self._score_device_batch(batch, request)
        body = {"model": self._model, "prompt": batch, "max_tokens": 1,
                "prompt_logprobs": self.cfg.k, "temperature": 0.0}
        payload = self._call("/v1/completions", body, request)
        t0 = time.perf_counter()
        rows = parse_completion_response(payload, batch, self.cfg.k, request)
        self._add_stats(parse_s=time.perf_counter() - t0, requests=1, tokens=sum(map(len, batch)))
        return rows

    def score(self, sequences: Sequence[Sequence[int]]) -> list[TopKTeacher]:
        seqs = check_sequences(sequences)
        self.check_server()
        size = self.cfg.batch_size
        batches = [seqs[i:i + size] for i in range(0, len(seqs), size)]
        failed = threading.Event()  # after the first failure, batches not yet started are skipped

        def run(batch):
            if failed.is_set():
                return None
            try:
                return self._score_batch(batch)
            except BaseException:
                failed.set()
                raise

        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(batches) or 1)) as pool:
            futures = [pool.submit(run, b) for b in batches]
            errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        scored = [row for f in futures for row in f.result()]
        check_outputs(seqs, scored, self.url)
        return scored
