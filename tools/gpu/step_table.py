"""Per-run step figures from `opkd train`'s metrics.jsonl files, as the Markdown rows of docs/benchmarks.md.

    python tools/gpu/step_table.py $OUT/train2_*_metrics.jsonl [--skip 1]
    python tools/gpu/step_table.py $OUT/train4_metrics.jsonl --gpus 4 --student /tmp/models/qwen3-8b \\
        --teacher /tmp/models/qwen3-14b --smi $OUT/train4.smi
    python tools/gpu/step_table.py $OUT/train8_ray_*_metrics.jsonl --shares --gpus 8 --student ...

Means over the steps after the first `--skip` (the first step compiles kernels and captures graphs).
With `--gpus` a second table gives the per-GPU figures of those steps: response tokens/s per GPU
(whole step and train stage), the model FLOP rate per GPU and MFU = (6*N_student + 2*N_teacher) *
response tokens / train seconds / GPUs / peak; N counts the weights of the matmuls a token goes
through (the output layer, not the input embedding's lookup), and prompt tokens are left out, so MFU
is a lower bound. `--smi` (lines `epoch seconds, GPU index, utilization %, used MiB`) adds each GPU's
mean utilization and peak memory over those steps: the window that ends at the metrics file's last
write (its mtime: copy it with `cp -p`) and lasts as long as the steps' `timing/step` sum. `--shares`
adds each stage's mean time as a share of the mean step; the shares add up to more than 100% where an
overlapped schedule runs stages side by side.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

from opkd_mcore.train.metrics import read_jsonl

COLUMNS = ("timing/rollout", "timing/teacher", "timing/train", "timing/weight_sync", "timing/step")
STAGES = COLUMNS[:-1]
PEAK_TFLOPS = 989.0  # H100 / H200 SXM, bf16 dense


def _rate(row: dict) -> float | None:
    if "perf/tokens_per_s" in row:
        return row["perf/tokens_per_s"]
    tokens = row.get("rollout/response_tokens")
    return tokens / row["timing/step"] if tokens and row.get("timing/step") else None


def _steps(path: str, skip: int) -> list[dict]:
    if not os.path.exists(path):  # read_jsonl takes a missing file for an empty run
        raise FileNotFoundError(f"{path}: no such metrics file")
    return [r for r in read_jsonl(path) if "timing/step" in r][skip:]


def summarize(path: str, skip: int) -> str:
    rows = _steps(path, skip)
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


def shares(path: str, skip: int) -> str:
    """Each stage's mean seconds over the mean step's, after `skip` steps, and their sum."""
    rows = _steps(path, skip)
    if not rows:
        return f"| {path} | no steps after the first {skip} |"
    step = statistics.fmean(r["timing/step"] for r in rows)
    cells, total = [], 0.0
    for key in STAGES:
        values = [r[key] for r in rows if key in r]
        share = 100 * statistics.fmean(values) / step if values else None
        total += share or 0.0
        cells.append("-" if share is None else f"{share:.0f}%")
    return (f"| {path.rsplit('/', 1)[-1]} | {len(rows)} | {step:.2f} | " + " | ".join(cells)
            + f" | {total:.0f}% |")


def model_params(model_dir: str) -> tuple[int, int]:
    """(weights, matmul weights) of a dense decoder's `config.json` (Qwen3 / Llama layout, no biases):
    the second leaves out the input embedding (a lookup) and counts the output layer once, tied or
    not; norm weights (< 0.01%) are left out of both."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    if c.get("num_experts") or c.get("num_local_experts"):
        raise ValueError(f"{path}: an MoE config; model_params counts dense decoders only")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * c["intermediate_size"]
    matmul = c["num_hidden_layers"] * layer + c["vocab_size"] * h
    return matmul + (0 if c.get("tie_word_embeddings") else c["vocab_size"] * h), matmul


def read_smi(path: str) -> list[tuple[float, int, float, float]]:
    """(time, GPU index, utilization %, used MiB) samples; lines that are not four numbers (a
    sampler killed mid-line, nvidia-smi's "[N/A]") are skipped."""
    samples = []
    with open(path) as f:
        for line in f:
            try:
                t, idx, util, used = (float(x) for x in line.split(","))
            except ValueError:
                continue
            samples.append((t, int(idx), util, used))
    return samples


def gpu_window(samples, start: float, end: float) -> dict[int, tuple[float, float]]:
    """GPU index -> (mean utilization %, peak used GiB) over the samples within [start, end]."""
    util, peak = collections.defaultdict(list), collections.defaultdict(float)
    for t, idx, u, used in samples:
        if start <= t <= end:
            util[idx].append(u)
            peak[idx] = max(peak[idx], used / 1024)
    return {idx: (statistics.fmean(util[idx]), peak[idx]) for idx in sorted(util)}


def efficiency(path: str, skip: int, gpus: int, n_student: int, n_teacher: int = 0,
               peak_tflops: float = PEAK_TFLOPS, smi: list | None = None, end: float | None = None) -> str:
    """The per-GPU row of a run: ratios of sums over the steps after `skip`. `smi`: `read_smi`'s
    samples, windowed to the steps (they end at `end`, seconds since the epoch)."""
    rows = _steps(path, skip)
    if not rows:
        return f"| {path} | no steps after the first {skip} |"
    tokens = sum(r["rollout/response_tokens"] for r in rows)
    step_s, train_s = sum(r["timing/step"] for r in rows), sum(r["timing/train"] for r in rows)
    tflops = (6 * n_student + 2 * n_teacher) * tokens / train_s / gpus / 1e12
    cells = [str(gpus), f"{step_s / len(rows):.2f}", f"{tokens / step_s / gpus:.0f}",
             f"{tokens / train_s / gpus:.0f}", f"{tflops:.0f}", f"{100 * tflops / peak_tflops:.1f}%"]
    if smi is not None:
        window = gpu_window(smi, end - step_s, end)
        cells.append(" / ".join(f"{u:.0f}" for u, _ in window.values()) or "-")
        cells.append(" / ".join(f"{p:.1f}" for _, p in window.values()) or "-")
    return f"| {path.rsplit('/', 1)[-1]} | {len(rows)} | " + " | ".join(cells) + " |"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="metrics.jsonl files")
    p.add_argument("--skip", type=int, default=1, help="leading steps left out of the means")
    p.add_argument("--gpus", type=int, help="GPUs of the runs: adds the per-GPU table")
    p.add_argument("--student", help="the student's checkpoint directory (config.json), for MFU")
    p.add_argument("--teacher", help="an in-step (dense Megatron) teacher's checkpoint directory, for MFU")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="one GPU's peak, TFLOP/s")
    p.add_argument("--smi", help="nvidia-smi samples: epoch seconds, index, utilization %%, used MiB")
    p.add_argument("--shares", action="store_true", help="adds each stage's share of the step")
    args = p.parse_args(argv)
    if args.gpus and not args.student:
        p.error("--gpus needs --student (the model FLOPs per token)")
    print("| run | steps | rollout s | teacher s | train s | weight sync s | step s | tokens/s | losses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.paths:
        print(summarize(path, args.skip))
    if args.shares:
        print("\n| run | steps | step s | rollout | teacher | train | weight sync | sum of stages |")
        print("|" + " --- |" * 8)
        for path in args.paths:
            print(shares(path, args.skip))
    if not args.gpus:
        return
    n_student = model_params(args.student)[1]
    n_teacher = model_params(args.teacher)[1] if args.teacher else 0
    smi = read_smi(args.smi) if args.smi else None
    print(f"\nN student {n_student / 1e9:.2f}B, N teacher {n_teacher / 1e9:.2f}B, "
          f"peak {args.peak_tflops:.0f} TFLOP/s per GPU")
    head = ("| run | steps | GPUs | step s | tokens/s per GPU | train tokens/s per GPU | TFLOP/s per GPU "
            "| MFU |")
    head += " GPU util % | peak GiB in the steps |" if smi is not None else ""
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for path in args.paths:
        print(efficiency(path, args.skip, args.gpus, n_student, n_teacher, args.peak_tflops, smi,
                         os.path.getmtime(path)))


if __name__ == "__main__":
    main()
