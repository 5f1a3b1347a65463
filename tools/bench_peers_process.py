"""How `opkd bench peers` runs a runner's processes: each in a session of its own, killed whole at its
deadline, with its log's tail in the error; the GPUs' peak memory over a run; a peer's interpreter probed
for its package before anything starts."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading

from bench_common import ROOT


class RunnerFailed(RuntimeError):
    """A runner could not run or its trainer failed: the message says what stopped it in one line,
    `detail` holds the end of its log."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


class GpuMemoryPeak:
    """Peak used memory per GPU (nvidia-smi every 200 ms, all processes) while the block runs."""

    def __init__(self):
        self.peak_mib: dict[int, int] = {}
        self._proc = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            try:
                idx, used = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.peak_mib[idx] = max(self.peak_mib.get(idx, 0), used)

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def gib(self, gpus: list[str]) -> list[float] | None:
        """Peaks of the given GPUs (nvidia-smi numbers the host's GPUs as CUDA_VISIBLE_DEVICES does)."""
        ids = [int(g) for g in gpus if g.isdigit() and int(g) in self.peak_mib]
        return [round(self.peak_mib[i] / 1024, 2) for i in ids] or None


def run_in_session(cmd: list[str], *, timeout_s: float | None, **popen_kwargs) -> int | None:
    """Run `cmd` in a session of its own; its exit code, or None when `timeout_s` passed first. At the
    deadline the whole session is killed: a peer's trainer leaves Ray workers and engines behind that
    would hold the GPUs through the next runner."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        return None
    except BaseException:  # Ctrl-C reaches only this process: the session is outside the terminal's group
        _kill_session(proc)
        raise


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_logged(cmd: list[str], log_path: str, *, env: dict | None = None, timeout_s: float | None = None,
               what: str) -> None:
    """Run `cmd` with its output in `log_path`; a failure raises RunnerFailed with the log's tail."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = run_in_session(cmd, timeout_s=timeout_s, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if rc != 0:
        with open(log_path) as f:
            lines = [line.rstrip() for line in f if line.strip()]
        raise RunnerFailed(f"{what}: {lines[-1] if lines else 'no output'} "
                           f"(exited {'timeout' if rc is None else rc}; log {log_path})",
                           "\n".join(lines[-25:]))


def python_can_import(python: str, module: str, env: dict | None = None) -> str:
    """`module`'s version as `python` sees it (in `env`); RunnerFailed naming the interpreter where it
    cannot."""
    probe = (f"import importlib.metadata as m, {module}; "
             f"print(getattr({module}, '__version__', None) or m.version('{module}'))")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise RunnerFailed(f"{module} is not importable by {python} ({last}); install it there "
                           f"(tools/gpu/README.md: carrying the peers' wheels) or pass --{module}-python")
    return out.stdout.strip()
