"""Teacher scoring throughput: in-process vLLM vs a teacher server, per top-k and per scoring path.

Scores `--num-seqs` random sequences of `--seq-len` tokens for each k in `--ks` and reports scored
tokens/s.

In process, each of `--paths` on the same tokens, one engine at a time: `prompt_logprobs` (vLLM's
per-position prompt logprobs), `device` (the output weight, log-softmax and top-k inside the
engine, packed rows back: `teacher/device_topk.py`) and `hidden` (final-norm hidden states, the
`output: hidden` engine). "x hidden" is a path's time over the hidden-state path's (in process, or
served: `--hidden`); a line after the table compares the device rows of the largest k with
prompt_logprobs' (largest logprob difference, share of equal ids: bf16 logits tie often, and tied
entries come in either order).

Remote, `opkd teacher-serve` with each scoring: `remote` (vLLM's server, prompt logprobs as JSON,
started with `--max-logprobs max(ks)` and prefix caching off) and `remote-device` (opkd's server,
packed rows computed on its device); `--hidden` adds a server started with `--output hidden`
(final-norm hidden states in bf16 for exact dense KD, the trainer holding the output weight: 2 x
hidden size bytes per token). Each reports the response bytes per scored token (what the network
carries) and how much of the client time per request goes to JSON decoding (`json.loads` of the
response) and to turning the response into tensors.

    python tools/bench_teacher.py [--model DIR] [--ks 20,64,256] [--hidden] [--out bench_teacher.json]
        [--results runs.jsonl]
    # the GPU step's teacher stage: 128 sequences x 268 tokens (~34K) of a Qwen3-1.7B-shaped teacher
    python tools/bench_teacher.py --model /tmp/models/qwen3-1.7b --dtype bfloat16 --ks 64 \
        --num-seqs 128 --seq-len 268 --skip-remote

Without `--model`, a random tiny Qwen3 checkpoint (vocab 1024, head_dim 64) is made in a temp dir.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import (add_results_argument, choices_list, positive_int, positive_ints,  # noqa: E402
                          record, run_metadata, time_it)

INPROCESS_PATHS = ("prompt_logprobs", "device", "hidden")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="teacher HF checkpoint (default: make a tiny one)")
    p.add_argument("--ks", type=positive_ints, default="20,64,256", help="comma-separated top-k values")
    p.add_argument("--num-seqs", type=positive_int, default=32, help="sequences per scoring call")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed calls per configuration (after 1 warm-up; p20 / p50 / p80 reported)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="remote: sequences per HTTP request")
    p.add_argument("--concurrency", type=positive_int, default=4, help="remote: HTTP requests in flight")
    p.add_argument("--timeout-s", type=float, default=900, help="remote: per-request timeout")
    p.add_argument("--paths", type=choices_list(INPROCESS_PATHS), default=",".join(INPROCESS_PATHS),
                   help=f"in-process scoring paths to time, comma-separated, of {','.join(INPROCESS_PATHS)}")
    p.add_argument("--dtype", default="float32", help="engines' dtype (bfloat16 on a GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="engines' accelerator share (one engine at a time)")
    p.add_argument("--skip-inprocess", action="store_true", help="only the remote path")
    p.add_argument("--skip-remote", action="store_true", help="only the in-process path")
    p.add_argument("--hidden", action="store_true",
                   help="remote: also a hidden-state server (exact dense KD)")
    p.add_argument("--out", default="bench_teacher.json", help="JSON results file")
    add_results_argument(p)
    return p.parse_args(argv)


def make_model(root: str) -> str:
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    shape = TinyModelShape(vocab_size=1024, hidden_size=256, num_layers=2, intermediate_size=512)
    return save_tiny_hf_model(os.path.join(root, "teacher"), shape=shape, seed=0, init_std=0.1)


def make_sequences(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def timed(fn, repeats: int) -> dict:
    """`seconds` (the median), `seconds_p20`, `seconds_p80` of `repeats` calls after one warm-up call."""
    return time_it(fn, warmup=1, repeats=repeats).row("seconds", digits=6)


def bench_inprocess(model_dir, seqs, ks, repeats, paths, dtype, memory) -> list[dict]:
    """Each path's engine in turn (built as `opkd train` builds it), timed per k on the same tokens."""
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    tokens, rows, last = sum(map(len, seqs)), [], {}
    for path in paths:
        output = "hidden" if path == "hidden" else "topk"
        base = VllmTeacher(model_dir, VllmTeacherConfig(
            k=max(ks), dtype=dtype, max_model_len=max(map(len, seqs)) + 8, gpu_memory_utilization=memory,
            output=output, scoring="auto" if output == "hidden" else path))
        try:
            for k in tqdm(ks if output == "topk" else [None], desc=path):
                teacher = base if k is None else VllmTeacher(base.llm, VllmTeacherConfig(k=k))
                t = timed(lambda: teacher.score(seqs), repeats)
                rows.append({"path": path, "k": k, **t, "tokens_per_s": tokens / t["seconds"]})
                if k in (None, max(ks)):
                    last[path] = teacher.score(seqs)
                print(json.dumps(rows[-1]), flush=True)  # partial results survive an interrupted run
        finally:
            base.close()
    for r in rows:
        if r["path"] == "device" and r["k"] == max(ks) and "prompt_logprobs" in last:
            r.update(_agreement(last["device"], last["prompt_logprobs"]))
    return rows


def add_hidden_ratios(rows: list[dict]) -> None:
    """`x_hidden`: each row's time over the hidden-state path's of its kind (in process, or served)."""
    hidden = {r["path"]: r["seconds"] for r in rows if r["path"] in ("hidden", "remote-hidden")}
    for r in rows:
        base = hidden.get("remote-hidden" if r["path"].startswith("remote") else "hidden")
        if base:
            r["x_hidden"] = r["seconds"] / base


def _agreement(got, want) -> dict:
    """How device rows compare with prompt_logprobs rows of the same sequences."""
    import torch

    diff = max(float((g.logprobs - w.logprobs).abs().max()) for g, w in zip(got, want))
    same = sum(int((g.ids == w.ids).sum()) for g, w in zip(got, want))
    return {"max_abs_logprob_diff": diff, "id_agreement": same / sum(g.ids.numel() for g in got),
            "same_id_sets": sum(int(torch.equal(g.ids.sort(1).values, w.ids.sort(1).values)) for g, w in
                                zip(got, want)) / len(got)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_remote(model_dir, seqs, ks, repeats, batch_size, concurrency, timeout_s, log_path, dtype, memory,
                 output: str = "topk", scoring: str = "prompt_logprobs") -> list[dict]:
    """One `opkd teacher-serve` server (vLLM's for prompt_logprobs and hidden states, opkd's for
    device scoring) and a client per k."""
    from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher
    from opkd_mcore.teacher.serve import TeacherServer, TeacherServerConfig

    scoring = "auto" if output == "hidden" else scoring
    cfg = TeacherServerConfig(model=model_dir, k=max(ks), port=_free_port(), dtype=dtype,
                              max_model_len=max(map(len, seqs)) + 8, output=output, scoring=scoring,
                              gpu_memory_utilization=memory)
    path = "remote-hidden" if output == "hidden" else "remote-device" if scoring == "device" else "remote"
    tokens = sum(map(len, seqs))
    rows = []
    with TeacherServer(cfg, log_path=log_path) as server:
        server.wait_ready(timeout_s=900)
        for k in tqdm(ks if output == "topk" else [None], desc=path):
            client = RemoteVllmTeacher(RemoteTeacherConfig(
                url=server.url, k=k or 1, batch_size=batch_size, max_concurrency=concurrency,
                timeout_s=timeout_s, max_retries=0, output=output, scoring=scoring))
            client.score(seqs[:1])  # server check + warm-up, not counted
            before = client.stats["wire_bytes"]
            t = timed(lambda: client.score(seqs), repeats)
            s = client.stats
            client_s = s["http_s"] + s["json_decode_s"] + s["parse_s"]
            rows.append({"path": path, "k": k, **t, "tokens_per_s": tokens / t["seconds"],
                         "bytes_per_token": (s["wire_bytes"] - before) / (tokens * (repeats + 1)),
                         "json_decode_share": s["json_decode_s"] / client_s,
                         "rows_to_tensors_share": s["parse_s"] / client_s})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ks = args.ks
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(tmp)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        seqs = make_sequences(args.num_seqs, args.seq_len, vocab)
        rows = []
        if not args.skip_inprocess:
            rows += bench_inprocess(model_dir, seqs, ks, args.repeats, args.paths, args.dtype,
                                    args.gpu_memory_utilization)
        if not args.skip_remote:
            remote = (model_dir, seqs, ks, args.repeats, args.batch_size, args.concurrency, args.timeout_s)
            engine = (args.dtype, args.gpu_memory_utilization)
            for scoring in ("prompt_logprobs", "device"):
                rows += bench_remote(*remote, os.path.join(tmp, f"server_{scoring}.log"), *engine,
                                     scoring=scoring)
            if args.hidden:
                rows += bench_remote(*remote, os.path.join(tmp, "server_hidden.log"), *engine,
                                     output="hidden")
    add_hidden_ratios(rows)
    meta = run_metadata(cpus=os.cpu_count(), num_seqs=args.num_seqs, seq_len=args.seq_len, vocab=vocab,
                        model=args.model or "tiny qwen3 (vocab 1024, hidden 256, 2 layers)")
    print(f"{'path':<15} {'k':>6} {'tokens/s':>10} {'s/call':>8} {'x hidden':>8} {'B/token':>8} "
          f"{'json share':>10} {'rows share':>10}")
    for r in rows:
        share = f"{r['json_decode_share']:.1%}" if "json_decode_share" in r else "-"
        parse = f"{r['rows_to_tensors_share']:.1%}" if "rows_to_tensors_share" in r else "-"
        wire = f"{r['bytes_per_token']:.0f}" if "bytes_per_token" in r else "-"
        ratio = f"{r['x_hidden']:.2f}" if "x_hidden" in r else "-"
        k = "hidden" if r["k"] is None else r["k"]
        print(f"{r['path']:<15} {k:>6} {r['tokens_per_s']:>10.0f} {r['seconds']:>8.3f} {ratio:>8} {wire:>8} "
              f"{share:>10} {parse:>10}")
    for r in rows:
        if "id_agreement" in r:
            print(f"device vs prompt_logprobs, k={r['k']}: largest logprob difference "
                  f"{r['max_abs_logprob_diff']:.2e}, equal ids {r['id_agreement']:.2%} of places, "
                  f"equal id sets {r['same_id_sets']:.0%} of sequences")
    record(args.results, meta, rows, table=False)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
