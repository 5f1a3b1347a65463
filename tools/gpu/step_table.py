"""Per-run step figures from `opkd train`'s metrics.jsonl files, as the Markdown rows of docs/benchmarks.md.

    python tools/gpu/step_table.py $OUT/train2_*_metrics.jsonl [--skip 1]

Means over the steps after the first `--skip` (the first step compiles kernels and captures graphs).
"""
from __future__ import annotations

import argparse
import os
import statistics

from opkd_mcore.train.metrics import read_jsonl

COLUMNS = ("timing/rollout", "timing/teacher", "timing/train", "timing/weight_sync", "timing/step")


def _rate(row: dict) -> float | None:
    if "perf/tokens_per_s" in row:
        return row["perf/tokens_per_s"]
    tokens = row.get("rollout/response_tokens")
    return tokens / row["timing/step"] if tokens and row.get("timing/step") else None


def summarize(path: str, skip: int) -> str:
    if not os.path.exists(path):  # read_jsonl takes a missing file for an empty run
        raise FileNotFoundError(f"{path}: no such metrics file")
    rows = [r for r in read_jsonl(path) if "timing/step" in r][skip:]
    if not rows:
        return f"| {path} | no steps after the first {skip} |"
    cells = []
    for key in COLUMNS:
        values = [r[key] for r in rows if key in r]
        cells.append(f"{statistics.fmean(values):.2f}" if values else "-")
    rates = [x for x in map(_rate, rows) if x is not None]
    cells.append(f"{statistics.fmean(rates):.0f}" if rates else "-")
    loss = [r["train/loss"] for r in rows if "train/loss" in r]
    cells.append(" ".join(f"{x:.4f}" for x in loss))
    return f"| {path.rsplit('/', 1)[-1]} | {len(rows)} | " + " | ".join(cells) + " |"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="metrics.jsonl files")
    p.add_argument("--skip", type=int, default=1, help="leading steps left out of the means")
    args = p.parse_args(argv)
    print("| run | steps | rollout s | teacher s | train s | weight sync s | step s | tokens/s | losses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.paths:
        print(summarize(path, args.skip))


if __name__ == "__main__":
    main()
