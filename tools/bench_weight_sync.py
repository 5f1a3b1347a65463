"""Benchmark a full weight sync against a raw broadcast of the same bytes on the same group.

Two processes: rank 0 holds a model of the given shape (HF-named tensors, on device 0) and sends it
with `BucketSender`; rank 1 stands in for the rollout side (vLLM is not needed): a `BucketReceiver`
that copies every received tensor into its own preallocated copy of the model, as `load_weights`
would. In the same run and on the same group, a raw broadcast loop moves the same total bytes in
messages of the same size from one reused buffer: the transport's ceiling. Prints a table, writes
JSON with --json, appends a row with the run's metadata with --results (tools/bench_common.py).

    python tools/bench_weight_sync.py --shape qwen3-8b --dtype bf16 --iters 5
    python tools/bench_weight_sync.py --shape tiny --device cpu        # smoke run on a laptop
    python tools/bench_weight_sync.py --e2e --shape qwen3-8b --layout tp1-disagg   # Megatron -> vLLM (GPU)
    opkd bench weight-sync --shape qwen3-8b
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # weight_sync_e2e, bench_common

from bench_common import add_results_argument, percentiles, record, run_metadata, time_it  # noqa: E402

# name -> (hidden, layers, intermediate, vocab, heads, kv_heads, head_dim)
SHAPES = {
    "qwen3-8b": (4096, 36, 12288, 151936, 32, 8, 128),
    "llama3-8b": (4096, 32, 14336, 128256, 32, 8, 128),
    "qwen3-1.7b": (2048, 28, 6144, 151936, 16, 8, 128),
    "tiny": (256, 4, 512, 1024, 4, 2, 64),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


E2E_OPTIONS = ("layout", "trainer_cpus", "model_dir", "layers", "tp_export", "profile")  # --e2e's alone


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny", help=f"model shape: {', '.join(SHAPES)} or H,L,I,V,heads,kv,hd")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weight dtype")
    p.add_argument("--bucket-mb", type=int, default=1024, help="bucket size of the plan, MiB")
    p.add_argument("--iters", type=int, default=3, help="timed repetitions of each measurement")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--device", default=None, help="cpu|cuda (default: auto)")
    p.add_argument("--transport", default="group", help="registered transport name")
    p.add_argument("--no-load", action="store_true", help="receiver skips copying into its model")
    p.add_argument("--same-device", action="store_true", help="both processes on device 0 (colocated)")
    p.add_argument("--stream-priority", default="high", choices=("high", "normal"),
                   help="device stream of the group's transfers (weight_sync.high_priority_stream)")
    p.add_argument("--json", default=None, help="write results here")
    add_results_argument(p)
    p.add_argument("--e2e", action="store_true",
                   help="end to end: Megatron export + transfer + load into a running vLLM engine (GPU)")
    p.add_argument("--layout", default="tp1-disagg",
                   help="--e2e: tp1-disagg | tp1-coloc | tp2-coloc | tp2-disagg (4 GPUs) | tp4-coloc (4 "
                        "GPUs) | tp4-disagg (5 GPUs) | ep2-coloc | ep2-disagg (4 GPUs; an MoE student's "
                        "experts over 2 ranks)")
    p.add_argument("--trainer-cpus", type=int, default=0,
                   help="--e2e: pin the trainer to this many CPUs and the engine to the rest (0: as started)")
    p.add_argument("--model-dir", default=None, help="--e2e: HF checkpoint to use (default: random, --shape)")
    p.add_argument("--layers", type=int, default=None,
                   help="--e2e without --model-dir: the named --shape with this many decoder layers")
    p.add_argument("--tp-export", default="auto", help="--e2e: weight_sync.tp_export (auto | gather | peer)")
    p.add_argument("--profile", default=None,
                   help="--e2e: profile one more sync, tables to PREFIX_rank{r}.txt")
    args = p.parse_args(argv)
    e2e_only = [f"--{name.replace('_', '-')}" for name in E2E_OPTIONS
                if getattr(args, name) != p.get_default(name)]
    if e2e_only and not args.e2e:
        p.error(f"{', '.join(e2e_only)}: only with --e2e (the raw two-process benchmark has no engine)")
    return args


def model_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    h, n_layers, inter, vocab, heads, kv, hd = (SHAPES[shape] if shape in SHAPES
                                                else map(int, shape.split(",")))
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * hd, h)),
                (p + "self_attn.k_proj.weight", (kv * hd, h)),
                (p + "self_attn.v_proj.weight", (kv * hd, h)),
                (p + "self_attn.o_proj.weight", (h, heads * hd)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _sync_device(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _make_tensors(shapes, dtype, device, fill: float):
    return {n: torch.full(s, fill, dtype=dtype, device=device) for n, s in shapes}


def timeline(send: dict[str, float], recv: dict[str, float], t0: float) -> dict[str, float]:
    """Milliseconds from `t0` to each mark of the last sync (`time.monotonic()`: one clock for every
    process of a host), both ends' in the order they came: `send_*` the sender's, `recv_*` the
    receiver's."""
    marks = {**{f"send_{k}": v for k, v in send.items()}, **{f"recv_{k}": v for k, v in recv.items()}}
    return {f"at_{k}_ms": (v - t0) * 1e3 for k, v in sorted(marks.items(), key=lambda kv: kv[1])}


def timed(fn, device, transport, iters, warmup) -> list[float]:
    """Seconds of each timed call of `fn(i)` (i counts the warm-up calls too: a sync's version); the
    samples, not percentiles: the sender's and the receiver's are reduced together by the caller."""
    calls = iter(range(warmup + iters))
    return time_it(lambda: fn(next(calls)), warmup, iters, lambda: _sync_device(device),
                   before_each=lambda: transport.exchange_status("")).samples  # both sides start together


def raw_broadcast(transport, buf, total_bytes, timeout):
    chunk = buf.numel()
    sent, pending = 0, None
    while sent < total_bytes:
        n = min(chunk, total_bytes - sent)
        if pending is not None:
            pending.wait(timeout)
        pending = transport.broadcast(buf, n)
        sent += n
    pending.wait(timeout)


def worker(rank: int, args, port: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    from opkd_mcore.platform import current_device, device_type
    from opkd_mcore.weight_sync import BucketPlan, BucketSender, TransportConfig, make_transport
    from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver

    kind = device_type(args.device)
    if kind == "cuda":
        torch.cuda.set_device(0 if args.same_device else rank)
    device = current_device(kind)
    dtype, shapes = DTYPES[args.dtype], model_shapes(args.shape)
    model = _make_tensors(shapes, dtype, device, 1.0 + rank)
    plan = BucketPlan.from_named_tensors(model.items(), args.bucket_mb << 20)
    cfg = TransportConfig(port=port, world_size=2, timeout_s=600, device=kind,
                          high_priority=args.stream_priority == "high")
    total = plan.total_bytes
    result = {"rank": rank}
    if rank == 0:
        transport = make_transport(args.transport, cfg, 0)
        sender = BucketSender(plan, transport)
        transport.connect()
        result["sync_s"] = timed(lambda i: sender.sync(iter(model.items()), i), device, transport,
                                  args.iters, args.warmup)
        result["marks"] = dict(sender.stats.last_marks)
        raw_buf = sender._buffers[0]
    else:
        receiver = BucketReceiver()
        receiver.join([cfg], 1, transport=args.transport)
        transport = receiver.transports[0]

        def load(named):
            if not args.no_load:
                for name, t in named:
                    model[name].copy_(t)
        result["sync_s"] = timed(lambda i: receiver.receive(load), device, transport, args.iters, args.warmup)
        s = receiver.stats
        result["marks"] = dict(s.last_marks, start=s.last_start_t, end=s.last_end_t)
        raw_buf = receiver._buffers[0]
        result["verified"] = all(bool((t == 1.0).all()) for t in model.values())
    raw_buf = raw_buf[:plan.max_bucket_nbytes()]
    result["raw_s"] = timed(lambda i: raw_broadcast(transport, raw_buf, total, 600), device, transport,
                             args.iters, args.warmup)
    result.update(total_bytes=total, num_buckets=len(plan.buckets), device=str(device),
                  device_name=torch.cuda.get_device_name(device) if kind == "cuda" else "cpu")
    transport.close()
    queue.put(result)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.e2e:
        from weight_sync_e2e import LAYOUTS, print_row, run_e2e

        if args.layout not in LAYOUTS:
            raise SystemExit(f"--layout: expected one of {', '.join(LAYOUTS)}, got {args.layout!r}")
        row = run_e2e(args)
        print_row(row)
        record(args.results, row["meta"], [{k: v for k, v in row.items() if k != "meta"}], table=False)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
        return 0 if row["engine_version"] == args.warmup + args.iters else 1
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    sender, receiver = results
    gb = sender["total_bytes"] / 1e9
    # a sync is done when the receiver has loaded the last bucket: time it there
    sync, raw = percentiles(receiver["sync_s"]), percentiles(receiver["raw_s"])
    sync_s, raw_s = sync["p50"], raw["p50"]
    row = dict(shape=args.shape, dtype=args.dtype, bucket_mb=args.bucket_mb, same_device=args.same_device,
               gbytes=round(gb, 3), buckets=sender["num_buckets"], sync_s=round(sync_s, 4),
               sync_s_p20=round(sync["p20"], 4), sync_s_p80=round(sync["p80"], 4),
               sync_gbps=round(gb / sync_s, 1),
               raw_s=round(raw_s, 4), raw_s_p20=round(raw["p20"], 4), raw_s_p80=round(raw["p80"], 4),
               raw_gbps=round(gb / raw_s, 1), ratio=round(raw_s / sync_s, 3),
               receiver_verified=receiver["verified"], device=sender["device_name"], transport=args.transport,
               load=not args.no_load, sync_all_s=receiver["sync_s"], raw_all_s=receiver["raw_s"],
               stream_priority=args.stream_priority,
               timeline={k: round(v, 4) for k, v in timeline(sender["marks"], receiver["marks"],
                                                                 sender["marks"]["start"]).items()},
               meta=run_metadata(device=sender["device_name"]))
    print("| transport | shape | dtype | GB | buckets | sync s | sync GB/s | raw s | raw GB/s | sync/raw |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.transport} | {row['shape']} | {row['dtype']} | {row['gbytes']} | {row['buckets']} | "
          f"{row['sync_s']} | {row['sync_gbps']} | {row['raw_s']} | {row['raw_gbps']} | {row['ratio']:.0%} |")
    print("the last sync, ms from the sender's start:",
          ", ".join(f"{k[3:-3]} {v}" for k, v in row["timeline"].items()))
    print(json.dumps(row))
    record(args.results, row["meta"], [{k: v for k, v in row.items() if k != "meta"}], table=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0 if receiver["verified"] or args.no_load else 1


if __name__ == "__main__":
    sys.exit(main())
