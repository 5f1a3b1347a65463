"""Benchmark the fused distillation loss against its peers, side by side, in one run.

For each shape and objective: median time of forward + backward (CUDA events), achieved GB/s,
% of the device-copy bandwidth measured in the same run, and peak extra memory, for
    fused        opkd_kernels (Triton), gradient written in place into the student logits
    reference    kd_loss(impl="reference"), the torch path (eager)
    compiled     the same objective written as plain torch, under torch.compile
    liger_jsd    Liger-Kernel's JSD on precomputed log-softmax inputs (dense objectives)
    megatron_ce  Megatron's vocab_parallel_cross_entropy on the same student logits: the
                 one-pass floor (reads the logits, writes their gradient)
Bytes counted: read student + read teacher (dense) + write gradient. Every method returns its
gradient through `torch.autograd.grad` (no `.grad` accumulation, which would clone a gradient
that aliases its input), so the peak extra memory includes each method's gradient buffer.

Launch (TP=1):  python tools/bench_kernels.py --out bench.json      (also `opkd bench kernels`)
        (TP=2): torchrun --nproc_per_node 2 tools/bench_kernels.py --out bench_tp2.json
CPU: --device cpu benchmarks the C++ twin against the reference path (wall clock).
--mode lm_head: the fused LM head (output layer + loss, no logits) against the GEMMs alone, the
unfused path, torch.compile, Liger's fused linear JSD and Cut Cross-Entropy (tools/bench_lm_head.py):
    python tools/bench_kernels.py --mode lm_head --out lm_head.json
    torchrun --nproc_per_node 2 tools/bench_kernels.py --mode lm_head --out lm_head_tp2.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common (`opkd bench` runs us by path)

from bench_common import add_results_argument, device_name, record, run_metadata, time_it  # noqa: E402

from opkd_kernels.fused_kd import KdSpec, fused_kd_loss  # noqa: E402
from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss  # noqa: E402

OBJECTIVES = {
    "forward_kl": dict(divergence="forward_kl"),
    "reverse_kl": dict(divergence="reverse_kl"),
    "jsd": dict(divergence="jsd", beta=0.5),
    "topk64": dict(support="teacher", mass="renorm", k_teacher=64),
    "topk256": dict(support="teacher", mass="renorm", k_teacher=256),
    "topk256_tail": dict(support="teacher", mass="tail", k_teacher=256),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x128256,16384x151936", help="NxV list (V = full vocabulary)")
    p.add_argument("--objectives", default="forward_kl,jsd,topk256", help=f"from {list(OBJECTIVES)}")
    p.add_argument("--methods", default="fused,reference,compiled,liger_jsd,megatron_ce",
                   help="columns to run")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="logits dtype")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per cell (p20 / p50 / p80 reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per cell")
    p.add_argument("--rounds", type=int, default=1,
                   help="lm_head: sweep the methods this many times, round robin, and report each "
                        "method's median over the rounds (a GPU that heats up makes later columns slower)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="cpu = C++ twin")
    p.add_argument("--out", default=None, help="write the JSON here")
    add_results_argument(p)
    p.add_argument("--profile", default=None,
                   help="logits mode: torch.profiler's kernel table of the fused method, written to "
                        "PREFIX_<objective>_tp<TP>.txt")
    p.add_argument("--mode", default="logits", choices=["logits", "lm_head"],
                   help="logits: the loss on given logits; lm_head: output layer + loss (GPU only)")
    p.add_argument("--hidden", type=int, default=4096, help="lm_head: hidden size H of student and teacher")
    args = p.parse_args(argv)
    if args.mode == "lm_head":   # its own defaults where the user left the logits mode's
        from tools.bench_lm_head import LM_HEAD_METHODS, LM_HEAD_OBJECTIVES

        if args.shapes == p.get_default("shapes"):
            args.shapes = "16384x151936"
        if args.objectives == p.get_default("objectives"):
            args.objectives = ",".join(LM_HEAD_OBJECTIVES)
        if args.methods == p.get_default("methods"):
            args.methods = LM_HEAD_METHODS
    return args


# ---------------------------------------------------------------- setup
def init_group(device: str):
    """TP group over all processes (torchrun), or a 1-process group so Megatron's CE can run."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return dist.group.WORLD, rank, dist.get_world_size()


def make_inputs(n, vocab, tp, rank, dtype, device, obj):
    v_local = vocab // tp
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    z = (torch.randn(n, v_local, generator=g, device=device, dtype=torch.float32) * 2).to(dtype)
    t = (torch.randn(n, v_local, generator=g, device=device, dtype=torch.float32) * 2).to(dtype)
    k = obj.get("k_teacher")
    if k is None:
        return z, DenseTeacher(t), None
    # teacher top-k ids spread over the whole vocabulary (every shard holds some)
    gk = torch.Generator(device=device).manual_seed(99)
    ids = torch.rand(n, vocab, generator=gk, device=device).topk(k, dim=1).indices
    logprobs = torch.log_softmax(torch.randn(n, k, generator=gk, device=device), dim=1) - 0.1
    del t
    return z, TopKTeacher(ids, logprobs), k


# ---------------------------------------------------------------- timing
def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _cuda_events(fn, synchronize) -> float:
    """Seconds of one call by CUDA events: the host's clock would add launch latency to short kernels."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def timed(fn, device, repeats, warmup, group):
    """({"p20", "p50", "p80"} ms, peak extra bytes) of fn(); max over TP ranks (the slowest rank is the
    call's time)."""
    barrier = (lambda: dist.barrier(group=group)) if dist.get_world_size(group) > 1 else None
    timing = time_it(fn, warmup, repeats, lambda: _sync(device), before_each=barrier,
                     timer=_cuda_events if device == "cuda" else None)
    peak = 0
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    stats = torch.tensor([timing.p20 * 1e3, timing.p50 * 1e3, timing.p80 * 1e3, float(peak)],
                         dtype=torch.float64, device=device if device == "cuda" else "cpu")
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    p20, p50, p80, peak = stats.tolist()
    return {"p20": p20, "p50": p50, "p80": p80}, int(peak)


def profile_table(fn, path, rank, device, iters=3):
    """torch.profiler's per-kernel table of `iters` calls (rank 0 writes it): where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        _sync(device)
    if rank == 0:
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=30))


def copy_bandwidth(z, device, repeats, group):
    """GB/s of a device copy of a logits-sized buffer (bytes read + written)."""
    dst = torch.empty_like(z)
    ms, _ = timed(lambda: dst.copy_(z), device, repeats, 2, group)
    return 2 * z.numel() * z.element_size() / ms["p50"] / 1e6


# ---------------------------------------------------------------- the methods
def _kd_kwargs(obj):
    return {k: v for k, v in obj.items() if k != "k_teacher"}


def method_fused(z, teacher, obj, group, device):
    kd = _kd_kwargs(obj)
    spec = KdSpec(divergence=kd.get("divergence", "forward_kl"), beta=kd.get("beta", 0.5),
                  support=kd.get("support"), mass=kd.get("mass", "renorm"))
    leaf = z.clone().requires_grad_()
    dense = isinstance(teacher, DenseTeacher)

    def run():
        loss = fused_kd_loss(leaf, teacher.logits if dense else None, None if dense else teacher.ids,
                             None if dense else teacher.logprobs, spec=spec, tp_group=group,
                             inplace_grad=True)
        return torch.autograd.grad(loss.sum(), leaf)
    return run


def method_reference(z, teacher, obj, group, device):
    leaf = z.clone().requires_grad_()
    kd = _kd_kwargs(obj)

    def run():
        return torch.autograd.grad(
            kd_loss(leaf, teacher, tp_group=group, impl="reference", validate=False, **kd).sum(), leaf)
    return run


def _plain_objective(z, t, divergence, beta):
    log_q = torch.log_softmax(z.float(), dim=-1)
    log_p = torch.log_softmax(t.float(), dim=-1)
    if divergence == "forward_kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if divergence == "reverse_kl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_p + torch.log(torch.tensor(beta)), log_q + torch.log(torch.tensor(1 - beta)))
    return (beta * log_p.exp() * (log_p - log_m) + (1 - beta) * log_q.exp() * (log_q - log_m)).sum(-1)


def method_compiled(z, teacher, obj, group, device):
    if not isinstance(teacher, DenseTeacher) or dist.get_world_size(group) > 1:
        return None
    fn = torch.compile(_plain_objective, dynamic=False)
    leaf = z.clone().requires_grad_()
    div, beta = obj.get("divergence", "forward_kl"), obj.get("beta", 0.5)

    def run():
        return torch.autograd.grad(fn(leaf, teacher.logits, div, beta).sum(), leaf)
    return run


def method_liger_jsd(z, teacher, obj, group, device):
    if not isinstance(teacher, DenseTeacher) or dist.get_world_size(group) > 1 or device != "cuda":
        return None
    try:
        from liger_kernel.transformers.jsd import LigerJSD
    except ImportError:
        return None
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(obj.get("divergence"), obj.get("beta", 0.5))
    jsd = LigerJSD(beta=beta)
    log_q = torch.log_softmax(z.float(), dim=-1).to(z.dtype).requires_grad_()
    log_p = torch.log_softmax(teacher.logits.float(), dim=-1).to(z.dtype)

    def run():
        return torch.autograd.grad(jsd(log_q, log_p), log_q)
    return run


def method_megatron_ce(z, teacher, obj, group, device):
    if device != "cuda":
        return None
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(group))
    vocab = z.shape[1] * dist.get_world_size(group)
    target = torch.randint(0, vocab, (z.shape[0],), device=z.device)
    leaf = z.clone().requires_grad_()

    def run():
        return torch.autograd.grad(vocab_parallel_cross_entropy(leaf, target).sum(), leaf)
    return run


METHODS = {"fused": method_fused, "reference": method_reference, "compiled": method_compiled,
           "liger_jsd": method_liger_jsd, "megatron_ce": method_megatron_ce}


# ---------------------------------------------------------------- driver
def bench_cell(n, vocab, name, args, group, rank, tp, device):
    obj = OBJECTIVES[name]
    dtype = getattr(torch, args.dtype)
    z, teacher, k = make_inputs(n, vocab, tp, rank, dtype, device, obj)
    copy_gbps = copy_bandwidth(z, device, args.repeats, group)
    elem = z.element_size()
    logits_bytes = z.numel() * elem
    moved = logits_bytes * (3 if k is None else 2)
    rows = []
    for method in args.methods.split(","):
        row = dict(n=n, vocab=vocab, tp=tp, objective=name, method=method, dtype=args.dtype)
        try:
            run = METHODS[method](z, teacher, obj, group, device)
            if run is None:
                continue
            pct, peak = timed(run, device, args.repeats, args.warmup, group)
            if args.profile and method == "fused":
                profile_table(run, f"{args.profile}_{name}_tp{tp}.txt", rank, device)
            ms = pct["p50"]
            gbps = moved / ms / 1e6
            row.update(ms=ms, ms_p20=pct["p20"], ms_p80=pct["p80"], gbps=gbps,
                       pct_copy=100 * gbps / copy_gbps, peak_extra_bytes=peak,
                       peak_extra_pct_of_logits=100 * peak / logits_bytes)
        except torch.cuda.OutOfMemoryError:
            row.update(error="OOM")
        except Exception as e:  # a peer failing must not hide the other columns
            row.update(error=f"{type(e).__name__}: {str(e)[:120]}")
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    for row in rows:
        row["copy_gbps"] = copy_gbps
    return rows


def print_table(rows):
    head = (f"{'N x V':>16} {'tp':>2} {'objective':>13} {'method':>12} {'ms':>9} {'p20-p80 ms':>15} "
            f"{'GB/s':>7} {'%copy':>6} {'extra mem':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = f"{r['n']}x{r['vocab']}"
        if "error" in r:
            print(f"{shape:>16} {r['tp']:>2} {r['objective']:>13} {r['method']:>12} {r['error']}")
            continue
        mem = f"{r['peak_extra_bytes'] / 2**30:.2f} GiB ({r['peak_extra_pct_of_logits']:.0f}%)"
        spread = f"{r['ms_p20']:.3f}-{r['ms_p80']:.3f}"
        print(f"{shape:>16} {r['tp']:>2} {r['objective']:>13} {r['method']:>12} {r['ms']:9.3f} {spread:>15} "
              f"{r['gbps']:7.0f} {r['pct_copy']:6.1f} {mem:>12}")


def main(argv=None):
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    group, rank, tp = init_group(device)
    rows = []
    if args.mode == "lm_head":
        from tools.bench_lm_head import bench_lm_head_cell, print_lm_head_table

        if device != "cuda":
            raise SystemExit("--mode lm_head: benchmarks the Triton tiles, needs a CUDA device")
    for shape in args.shapes.split(","):
        n, vocab = (int(x) for x in shape.lower().split("x"))
        for name in args.objectives.split(","):
            if args.mode == "lm_head":
                rows += bench_lm_head_cell(n, args.hidden, vocab, name, args, group, rank, tp, timed)
            else:
                rows += bench_cell(n, vocab, name, args, group, rank, tp, device)
    if rank == 0:
        (print_lm_head_table if args.mode == "lm_head" else print_table)(rows)
        meta = run_metadata(device=device_name(device), tp=tp, mode=args.mode)
        record(args.results, meta, rows, table=False)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
