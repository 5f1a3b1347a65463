"""End-to-end weight sync: Megatron student -> export -> transport -> load into a running vLLM engine.

`bench_weight_sync.py --e2e` runs this. What a sync costs in `opkd train`, measured with the
trainer's own parts (`train.components.build_weight_sync`): Megatron export (TP gather, QKV / gate-up
un-fusing), the bucketed transfer, and vLLM's layerwise reload of every tensor into the engine,
ending when the engine reports the new version. In the same run, on the same two devices, a raw
transfer of the same bytes in the same message size is the ceiling:

    layout        trainer ranks          vLLM engine   transport       raw ceiling
    tp1-disagg    1 rank on GPU 1        GPU 0         group (NCCL)    NCCL broadcast GPU 1 -> GPU 0
    tp1-coloc     1 rank on GPU 0        GPU 0         colocated_ipc   IPC copy on GPU 0
    tp2-coloc     2 ranks on GPU 0, 1    GPU 0         colocated_ipc   IPC copy on GPU 0
    tp2-disagg    2 ranks on GPU 2, 3    GPU 0         group (NCCL)    NCCL broadcast GPU 1 -> GPU 0
    tp4-coloc     4 ranks on GPU 0-3     GPU 0         colocated_ipc   IPC copy on GPU 0
    tp4-disagg    4 ranks on GPU 4-7     GPU 0         group (NCCL)    NCCL broadcast GPU 1 -> GPU 0
    ep2-coloc     2 ranks on GPU 0, 1    GPU 0         colocated_ipc   IPC copy on GPU 0
    ep2-disagg    2 ranks on GPU 2, 3    GPU 0         group (NCCL)    NCCL broadcast GPU 1 -> GPU 0

The ep2 layouts split an MoE student's experts over the two ranks (each sends its own experts, the
engine loads them into vLLM's fused-MoE tensors). For the colocated layouts the run also times the
disaggregated yardstick, an NCCL broadcast of the same bytes from GPU 1 to GPU 0 (`raw_nccl_s`).
`--profile PREFIX`: one more sync under torch.profiler on every trainer rank, its tables in
PREFIX_rank{r}.txt. `--device cpu` runs tp1 and ep2 layouts on the CPU (gloo, a vLLM CPU engine,
float32): the tests' smoke run of this path, no timing worth reporting.

    python tools/bench_weight_sync.py --e2e --shape qwen3-8b --layout tp1-disagg --iters 5
    python tools/bench_weight_sync.py --e2e --shape qwen3-30b-a3b --layers 8 --layout ep2-coloc
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from typing import NamedTuple

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_weight_sync, bench_common, beside this
from bench_common import percentiles, run_metadata, time_it  # noqa: E402
from bench_weight_sync import raw_broadcast, timed, timeline  # noqa: E402


class Layout(NamedTuple):
    ranks: int  # trainer ranks
    first_gpu: int  # the first trainer rank's GPU (the engine is on GPU 0)
    transport: str
    split: str = "tp"  # what the ranks split: "tp" (tensor parallel) or "ep" (the MoE experts)


LAYOUTS = {
    "tp1-disagg": Layout(1, 1, "group"),
    "tp1-coloc": Layout(1, 0, "colocated_ipc"),
    "tp2-coloc": Layout(2, 0, "colocated_ipc"),
    # 4 GPUs; the peer export's writes cross the interconnect, then the send
    "tp2-disagg": Layout(2, 2, "group"),
    # 4 and 5 GPUs: the TP=4 students of configs/gpu_qwen3_8b_from_32b_x8.yaml and its Ray variant
    "tp4-coloc": Layout(4, 0, "colocated_ipc"),
    "tp4-disagg": Layout(4, 4, "group"),
    "ep2-coloc": Layout(2, 0, "colocated_ipc", "ep"),
    "ep2-disagg": Layout(2, 2, "group", "ep"),  # 4 GPUs
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(shape: str, out_dir: str, layers: int | None = None) -> str:
    """A random bf16 HF checkpoint of a named shape (initialised on the GPU: seconds for 8B), with
    `layers` decoder layers instead of the shape's own when given."""
    from opkd_mcore.data import ALPHABET
    from opkd_mcore.models.tiny import named_shape, save_tiny_hf_model

    family, model_shape = named_shape(shape, layers)
    return save_tiny_hf_model(out_dir, family, model_shape, seed=1, alphabet=ALPHABET,
                              dtype=torch.bfloat16, device="cuda")


def _on_cpu(args) -> bool:
    from opkd_mcore.platform import is_cpu

    return is_cpu(args.device)


def _transport(args) -> str:
    """The layout's transport; on the CPU always the gloo group (device IPC needs an accelerator)."""
    return "group" if _on_cpu(args) else LAYOUTS[args.layout].transport


def _model_info(model_dir: str) -> dict:
    """What the row names the checkpoint by: its architecture, layers and routed experts (dense: 0)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    return {"architecture": hf["architectures"][0], "layers": hf["num_hidden_layers"], "experts": experts,
            "experts_per_token": hf.get("num_experts_per_tok") if experts else None}


def _synchronize(args) -> None:
    if not _on_cpu(args):
        torch.cuda.synchronize()


def _trainer(rank: int, args, model_dir: str, port: int, queue) -> None:
    layout, cpu = LAYOUTS[args.layout], _on_cpu(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(layout.ranks), LOCAL_RANK=str(0 if cpu else layout.first_gpu + rank))
    from opkd_mcore.config import TrainConfig
    from opkd_mcore.train.components import build_rollout, build_student, build_weight_sync, init_distributed

    cfg = TrainConfig()
    # float32 on the CPU: what its vLLM engine runs everywhere
    cfg.model.student, cfg.model.params_dtype = model_dir, "float32" if cpu else "bfloat16"
    cfg.run.device = "cpu" if cpu else None
    setattr(cfg.parallel, layout.split, layout.ranks)
    cfg.rollout.gpu_memory_utilization, cfg.rollout.max_model_len = 0.3, 256
    cfg.weight_sync.bucket_mb, cfg.weight_sync.transport = args.bucket_mb, _transport(args)
    cfg.weight_sync.tp_export = args.tp_export
    cfg.weight_sync.high_priority_stream = args.stream_priority == "high"
    rollout = build_rollout(cfg) if rank == 0 else None  # vLLM's worker takes GPU 0
    if rollout is not None and args.trainer_cpus:
        _split_cpus(args.trainer_cpus)
    init_distributed(cfg)
    _, chunks = build_student(model_dir, None, cfg.model.params_dtype)
    syncer = build_weight_sync(chunks, rollout, cfg)
    versions, phases = iter(range(1, args.warmup + args.iters + 1)), []
    # returns once every engine worker has loaded the version
    times = time_it(lambda: syncer.sync(next(versions)), args.warmup, args.iters, lambda: _synchronize(args),
                    before_each=torch.distributed.barrier,
                    after_each=lambda: phases.append(_phases(syncer) if rank == 0 else None)).samples
    phases = phases[args.warmup:]
    if args.profile:
        _profiled_sync(syncer, args.warmup + args.iters + 1, f"{args.profile}_rank{rank}.txt")
    # per bucket of the last timed sync, in the order received: (source, bucket, wait s, load s)
    per_bucket = syncer.handle.stats()[0]["last_buckets"] if syncer.handle is not None else []
    rpc = _idle_rpc(syncer.handle) if syncer.handle is not None else None
    stats = syncer.export.sender.stats if syncer.export.sender is not None else None
    plan = syncer.export.plan
    if rank == 0:
        version = rollout.weight_version
        queue.put({"sync_s": times, "version": version, "total_bytes": plan.total_bytes,
                   "buckets": len(plan.buckets), "max_bucket": plan.max_bucket_nbytes(),
                   "handshakes": None if stats is None else stats.handshakes, "phases": phases,
                   "device": "cpu" if cpu else torch.cuda.get_device_name(0), "idle_rpc": rpc,
                   "per_bucket": [[int(a), int(b), round(w, 5), round(ld, 5)] for a, b, w, ld in per_bucket],
                   "cpus": _cpu_sets()})
    syncer.close()
    if rollout is not None:
        rollout.shutdown()


def _profiled_sync(syncer, version: int, path: str) -> None:
    """One more sync under torch.profiler (host and device): the ops by host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        syncer.sync(version)
        torch.cuda.synchronize()
    events = prof.key_averages()
    with open(path, "w") as f:
        for key in ("cpu_time_total", "self_cpu_time_total", "device_time_total"):
            f.write(f"sorted by {key}\n{events.table(sort_by=key, row_limit=30, max_name_column_width=70)}\n")


def _phases(syncer) -> dict:
    """Host seconds of the last sync by phase: the sender's export + pack and its waits, the first
    engine worker's load, its waits for bytes, and vLLM's layerwise reload set-up + finalize; and
    how many buckets each end replayed (`weight_sync/copy_replay.py`)."""
    sender = syncer.export.sender
    out = {} if sender is None else {"pack_s": sender.stats.last_pack_s,
                                     "send_wait_s": sender.stats.last_wait_s,
                                     "sent_replayed": sender.stats.last_replayed}
    if syncer.handle is not None:
        worker, t = syncer.handle.stats()[0], syncer.handle.last_receive_t
        out.update(load_s=worker["last_load_s"], recv_wait_s=worker["last_wait_s"],
                   reload_s=worker["last_reload_s"],
                   # layerwise reload: the most layers vLLM held incomplete at once (buffering their
                   # loaded tensors), and the copies of those out of the receive buffers
                   layers_in_flight_max=worker["last_layers_in_flight_max"],
                   held_copy_mb=worker["last_deferred_copy_bytes"] / 1e6,
                   held_copy_s=worker["last_deferred_copy_s"],
                   loaded_replayed=worker["last_replayed"],
                   # lent buckets on another device than the engine's, copied whole before the load
                   loaded_staged=worker["last_staged"],
                   # the engine calls around the receive, posted together (receive, version stamp;
                   # the rollout salts its prefix cache, so no reset): posting, reaching the
                   # worker, hearing back, the stamp's answer after the receive's
                   post_s=t["sent"] - t["asked"], rpc_reach_s=worker["last_start_t"] - t["sent"],
                   # of which the worker's own prologue (replay bookkeeping) before the receiver starts
                   prologue_s=worker["last_start_t"] - worker["last_enter_t"],
                   rpc_answer_s=t["receive"] - worker["last_end_t"],
                   stamp_s=t.get("stamp", t["receive"]) - t["receive"])
        out.update(_timeline(t, worker, sender))
    return out


def _timeline(t: dict, worker: dict, sender) -> dict:
    """Milliseconds from the trainer's engine call to each step of the last sync (one host, one
    clock): what the sync waits for before the first byte moves and after the last one lands."""
    send = sender.stats.last_marks if sender is not None else {}
    recv = dict(worker["last_marks"], start=worker["last_start_t"], end=worker["last_end_t"])
    return {**timeline(send, recv, t["asked"]), "at_answered_ms": (t["receive"] - t["asked"]) * 1e3}


def _idle_rpc(handle, calls: int = 10) -> dict:
    """An engine call with nothing else running: median seconds to reach a worker and back."""
    reach, back = [], []
    for _ in range(calls):
        sent = time.monotonic()
        worker_t = handle._worker_call("opkd_clock").result()[0]
        back.append(time.monotonic() - worker_t)
        reach.append(worker_t - sent)
    return {"idle_rpc_reach_s": round(percentiles(reach)["p50"], 5),
            "idle_rpc_answer_s": round(percentiles(back)["p50"], 5)}


def _cpu_sets() -> dict:
    """How many CPUs this process and its children (the engine core, its workers) may run on."""
    import psutil

    me = psutil.Process()
    return {f"{p.name()}:{p.pid}": len(p.cpu_affinity()) for p in (me, *me.children(recursive=True))}


def _split_cpus(n: int) -> None:
    """Every thread of this process on the last `n` allowed CPUs, every thread of its children (the
    engine) on the others: whether the two contend for CPUs while a sync runs."""
    import psutil

    allowed = sorted(os.sched_getaffinity(0))
    mine, theirs = set(allowed[-n:]), set(allowed[:-n])
    me = psutil.Process()
    for proc, cpus in ((me, mine), *((child, theirs) for child in me.children(recursive=True))):
        for thread in proc.threads():
            try:
                os.sched_setaffinity(thread.id, cpus)
            except OSError:  # a thread that ended meanwhile
                pass


def _raw(rank: int, args, port: int, total_bytes: int, chunk: int, transport_name: str, queue) -> None:
    """Sender on the trainer's GPU (for NCCL: GPU 1), receiver on the engine's GPU 0: the same
    bytes, the same chunks (colocated: one copy out of the sender's buffers into the receiver's)."""
    from opkd_mcore.weight_sync import TransportConfig, make_transport

    cpu = _on_cpu(args)
    if not cpu:
        first_gpu = LAYOUTS[args.layout].first_gpu if transport_name != "group" else 1
        torch.cuda.set_device(first_gpu if rank == 0 else 0)
    cfg = TransportConfig(port=port, world_size=2, timeout_s=600, device="cpu" if cpu else None,
                          high_priority=args.stream_priority == "high")
    transport = make_transport(transport_name, cfg, rank)
    transport.connect()
    buf = transport.alloc_buffer(chunk)
    times = timed(lambda i: raw_broadcast(transport, buf, total_bytes, 600),
                  torch.device("cpu" if cpu else "cuda"), transport, args.iters, args.warmup)
    transport.close()
    queue.put((rank, times))


def _run(target, nprocs: int, *args) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(nprocs)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=3600) for _ in range(nprocs if target is _raw else 1)]
    for p in procs:
        p.join(60)
        if p.is_alive():  # the figures are in hand: a slow teardown must not hold the run
            p.kill()
    return out


def run_e2e(args) -> dict:
    model_dir = args.model_dir or make_checkpoint(args.shape, tempfile.mkdtemp(prefix=f"{args.shape}-"),
                                                  args.layers)
    layout = LAYOUTS[args.layout]
    (e2e,) = _run(_trainer, layout.ranks, args, model_dir, _free_port())
    # printed before the raw transfer runs: a time limit that cuts the run short keeps this half
    print(f"e2e syncs done: {args.layout} {args.shape}, {e2e['total_bytes'] / 1e9:.2f} GB, "
          f"seconds {e2e['sync_s']}, phases {e2e['phases'][-1]}", flush=True)
    transport = _transport(args)
    raw = dict(_run(_raw, 2, args, _free_port(), e2e["total_bytes"], e2e["max_bucket"], transport))
    # one yardstick for every layout: an NCCL broadcast of the same bytes between the GPUs
    nccl = raw if transport == "group" else dict(_run(_raw, 2, args, _free_port(), e2e["total_bytes"],
                                                       e2e["max_bucket"], "group"))
    gb = e2e["total_bytes"] / 1e9
    sync = percentiles(e2e["sync_s"])
    sync_s, raw_s, nccl_s = sync["p50"], percentiles(raw[1])["p50"], percentiles(nccl[1])["p50"]
    phases = {k: round(percentiles([p[k] for p in e2e["phases"]])["p50"], 4) for k in e2e["phases"][0]}
    return dict(mode="e2e", layout=args.layout, parallel={layout.split: layout.ranks}, shape=args.shape,
                gbytes=round(gb, 3), buckets=e2e["buckets"],
                bucket_mb=args.bucket_mb, sync_s=round(sync_s, 4), sync_s_p20=round(sync["p20"], 4),
                sync_s_p80=round(sync["p80"], 4), sync_gbps=round(gb / sync_s, 1),
                raw_s=round(raw_s, 4), raw_gbps=round(gb / raw_s, 1), ratio=round(raw_s / sync_s, 3),
                raw_nccl_s=round(nccl_s, 4), ratio_nccl=round(nccl_s / sync_s, 3),
                engine_version=e2e["version"], device=e2e["device"], sync_all_s=e2e["sync_s"],
                raw_all_s=raw[1], phases=phases, per_bucket=e2e["per_bucket"], idle_rpc=e2e["idle_rpc"],
                cpus=e2e["cpus"],
                trainer_cpus=args.trainer_cpus, tp_export=args.tp_export,
                stream_priority=args.stream_priority, model_dir=model_dir, **_model_info(model_dir),
                meta=run_metadata(device=e2e["device"]))


def print_row(row: dict) -> None:
    print("| layout | shape | layers | experts | GB | buckets | e2e sync s | e2e GB/s | raw s | raw GB/s "
          "| e2e / raw | raw NCCL s | e2e / raw NCCL |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {row['layout']} | {row['shape']} | {row['layers']} | {row['experts']} | {row['gbytes']} | "
          f"{row['buckets']} | {row['sync_s']} | "
          f"{row['sync_gbps']} | {row['raw_s']} | {row['raw_gbps']} | {row['ratio']:.0%} | "
          f"{row['raw_nccl_s']} | {row['ratio_nccl']:.0%} |")
    print("host seconds by phase (medians):", ", ".join(f"{k} {v}" for k, v in row["phases"].items()))
    slowest = sorted(row.get("per_bucket", []), key=lambda b: -b[3])[:5]
    print("slowest bucket loads of the last sync (source, bucket, wait s, load s):", slowest)
    if row.get("idle_rpc"):
        print("an engine call alone:", ", ".join(f"{k} {v}" for k, v in row["idle_rpc"].items()))
    print("CPUs each process may use:", row.get("cpus"), "trainer pinned to", row.get("trainer_cpus"))
    print(json.dumps(row))
