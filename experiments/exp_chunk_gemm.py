"""Experiment: cuBLAS rate of the rows engine's chunk GEMMs against the whole-matrix GEMM.

The rows engine forms logits one chunk of R rows at a time; `torch.profiler` showed its logits GEMMs
at ~700 TFLOP/s against ~790 for all 16384 rows at once on an H200. This times each of the engine's
three GEMM shapes (logits h[R] W^T, dh = dz W, dW += dz^T h[R]) per R and per torch entry point, as
TFLOP/s, CUDA events, median of `--repeats`.

    python experiments/exp_chunk_gemm.py --rows 1024,2048,4096,8192,16384
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def rate(fn, flops, repeats):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return ms, flops / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,2048,4096,8192,16384")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    dt = torch.bfloat16
    h = torch.randn(max(map(int, args.rows.split(","))), args.hidden, device="cuda", dtype=dt)
    w = torch.randn(args.vocab, args.hidden, device="cuda", dtype=dt)
    dw = torch.zeros_like(w)
    print(f"{'R':>6} {'gemm':<28} {'ms':>8} {'TFLOP/s':>8}")
    for r in map(int, args.rows.split(",")):
        x = h[:r]
        dz = torch.randn(r, args.vocab, device="cuda", dtype=dt)
        flops = 2 * r * args.vocab * args.hidden
        cases = {
            "logits x @ w.T": lambda: x @ w.T,
            "logits F.linear(x, w)": lambda: F.linear(x, w),
            "logits (w @ x.T).T": lambda: torch.mm(w, x.T),
            "dh dz @ w": lambda: dz @ w,
            "dW addmm_(dz.T, x)": lambda: dw.addmm_(dz.T, x),
            "dW mm(dz.T, x)": lambda: torch.mm(dz.T, x),
        }
        for name, fn in cases.items():
            ms, tf = rate(fn, flops, args.repeats)
            print(f"{r:>6} {name:<28} {ms:8.3f} {tf:8.0f}")
        cases.clear()  # the lambdas hold dz: free it before the next, larger one


if __name__ == "__main__":
    main()
