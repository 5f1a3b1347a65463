"""`opkd teacher-serve --scoring device`: an HTTP server whose top-k rows are computed on its device.

It owns one in-process vLLM teacher scoring on the engine's device (`teacher/device_topk.py`) and
answers with packed tensors instead of JSON objects per position (`teacher/topk_wire.py` says the
format). Requests that arrive while the engine is busy are scored together in its next call
(grouped by k and temperature), so a client's concurrent batches fill the engine as one batch would.

    GET  /v1/models      {"object": "list", "data": [{"id", "object": "model", "max_model_len", "root"}]}
                         (what a vLLM OpenAI server lists: readiness checks and clients read it alike)
    GET  /opkd/v1/topk   what the route serves (format, vocabulary size, max_model_len, model)
    POST /opkd/v1/topk   top-k rows of token sequences

    python -m opkd_mcore.teacher.score_server --model DIR [--host H] [--port P] [--tp N] [--dtype D]
        [--max-model-len L] [--gpu-memory-utilization F] [--served-model-name NAME]

(`opkd teacher-serve --scoring device` runs exactly this.)
"""
from __future__ import annotations

import argparse
import http.server
import json
import logging
import queue
import threading
from collections import defaultdict

from opkd_mcore.losses.teacher_outputs import TopKTeacher
from opkd_mcore.teacher.topk_wire import MAGIC, TOPK_ROUTE, RequestError, encode_topk_response, parse_request
from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

logger = logging.getLogger(__name__)


class _Job:
    def __init__(self, seqs: list[list[int]], k: int, temperature: float):
        self.seqs, self.key = seqs, (k, temperature)
        self.done = threading.Event()
        self.rows: list[TopKTeacher] | None = None
        self.error: BaseException | None = None


class BatchingScorer:
    """One thread scores every request: what is queued when it turns to the queue goes into one call
    per (k, temperature). `score_fn(sequences, k, temperature)` returns one `TopKTeacher` each."""

    def __init__(self, score_fn):
        self._score_fn = score_fn
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="opkd-topk-scorer", daemon=True)
        self._thread.start()

    def score(self, seqs: list[list[int]], k: int, temperature: float) -> list[TopKTeacher]:
        job = _Job(seqs, k, temperature)
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.rows

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            stop = None in jobs
            groups = defaultdict(list)
            for job in jobs:
                if job is not None:
                    groups[job.key].append(job)
            for (k, temperature), group in groups.items():
                self._score_group(group, k, temperature)
            if stop:
                return

    def _score_group(self, group: list[_Job], k: int, temperature: float) -> None:
        try:
            rows = self._score_fn([s for job in group for s in job.seqs], k, temperature)
        except Exception as err:  # handed to every waiting request, which answers HTTP 500
            for job in group:
                job.error = err
                job.done.set()
            return
        start = 0
        for job in group:
            job.rows, start = rows[start:start + len(job.seqs)], start + len(job.seqs)
            job.done.set()


# ---- the server ---------------------------------------------------------------------------------

class TopKScoreServer:
    """The HTTP server over `score_fn(sequences, k, temperature) -> [TopKTeacher]` (`engine_scorer`)."""

    def __init__(self, score_fn, *, vocab_size: int, name: str, max_model_len: int, host: str = "127.0.0.1",
                 port: int = 8000):
        self.vocab_size, self.name, self.max_model_len = vocab_size, name, max_model_len
        self.scorer = BatchingScorer(score_fn)
        self.httpd = http.server.ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def info(self) -> dict:
        return {"format": MAGIC.decode(), "vocab_size": self.vocab_size,
                "max_model_len": self.max_model_len, "model": self.name}

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Answer until `shutdown()` (from another thread) or an interrupt, then release the socket and
        the scoring thread."""
        logger.info("top-k scoring server for %s on %s%s", self.name, self.url, TOPK_ROUTE)
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()
            self.scorer.close()

    def shutdown(self) -> None:
        """Make `serve_forever`, running in another thread, return."""
        self.httpd.shutdown()


def engine_scorer(teacher: VllmTeacher):
    """`score_fn` over a device-scoring `VllmTeacher`'s engine: one teacher per (k, temperature) on it,
    each setting the engine's scorer before it scores (calls come one at a time)."""
    views: dict = {}

    def score(seqs, k, temperature):
        if (k, temperature) not in views:
            if len(views) >= 64:  # clients' settings are few; a client cycling through many cannot grow this
                views.clear()
            views[k, temperature] = VllmTeacher(teacher.llm, VllmTeacherConfig(k=k, temperature=temperature))
        return views[k, temperature].score(seqs)

    return score


def _handler(server: TopKScoreServer):
    class TopKScoreHandler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            logger.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, payload: dict) -> None:
            self._send(code, json.dumps(payload).encode())

        def _error(self, code: int, message: str) -> None:
            self._json(code, {"error": {"message": message, "code": code}})

        def do_GET(self):
            if self.path == "/v1/models":
                entry = {"id": server.name, "object": "model", "max_model_len": server.max_model_len,
                         "root": server.name}
                self._json(200, {"object": "list", "data": [entry]})
            elif self.path == TOPK_ROUTE:
                self._json(200, server.info)
            else:
                self._error(404, f"no route {self.path} (this server answers {TOPK_ROUTE} and /v1/models)")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != TOPK_ROUTE:
                self._error(404, f"no route {self.path} (this server scores at {TOPK_ROUTE})")
                return
            try:
                seqs, k, temperature = parse_request(json.loads(body or b"null"), server.vocab_size,
                                                     server.max_model_len)
            except (RequestError, ValueError) as err:
                self._error(400, str(err))
                return
            try:
                rows = server.scorer.score(seqs, k, temperature)
            except Exception as err:  # the engine failed: the client retries or names this server
                logger.exception("scoring %d sequences failed", len(seqs))
                self._error(500, f"scoring failed: {err!r}")
                return
            self._send(200, encode_topk_response(rows), "application/octet-stream")

    return TopKScoreHandler


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m opkd_mcore.teacher.score_server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="teacher HF checkpoint dir (student's tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine")
    p.add_argument("--dtype", default="auto", help="engine dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence scored")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="engine's accelerator share")
    p.add_argument("--served-model-name", default=None, help="model name clients see; default: --model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    teacher = VllmTeacher(args.model, VllmTeacherConfig(
        k=1, scoring="device", tensor_parallel_size=args.tp, dtype=args.dtype,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization))
    try:
        max_model_len = int(teacher.llm.llm_engine.model_config.max_model_len)
        TopKScoreServer(engine_scorer(teacher), vocab_size=teacher.vocab_size,
                        name=args.served_model_name or args.model, max_model_len=max_model_len,
                        host=args.host, port=args.port).serve_forever()
    finally:
        teacher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
