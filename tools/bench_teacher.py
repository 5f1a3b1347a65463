"""Teacher scoring throughput: in-process vLLM vs a remote vLLM OpenAI server, per top-k.

Scores `--num-seqs` random sequences of `--seq-len` tokens with top-k prompt logprobs for each k
in `--ks` and reports scored tokens/s. For the remote path it also reports the response bytes per
scored token (what the network carries) and how much of the client time per request goes to JSON
decoding (`json.loads` of the response) and to turning the decoded rows into tensors. The server
is started with `--max-logprobs max(ks)` (256 needs it raised from vLLM's default of 20) and prefix
caching off, exactly as `opkd teacher-serve` does. `--hidden` adds a second server started as
`opkd teacher-serve --output hidden` (final-norm hidden states in bf16 for exact dense KD, the
trainer holding the output weight), measured the same way: bytes per token 2 x hidden size.

    python tools/bench_teacher.py [--model DIR] [--ks 20,64,256] [--hidden] [--out bench_teacher.json]
        [--results runs.jsonl]

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

from bench_common import add_results_argument, record, run_metadata, time_it  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="teacher HF checkpoint (default: make a tiny one)")
    p.add_argument("--ks", default="20,64,256", help="comma-separated top-k values")
    p.add_argument("--num-seqs", type=int, default=32, help="sequences per scoring call")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per configuration (after 1 warm-up; p20 / p50 / p80 reported)")
    p.add_argument("--batch-size", type=int, default=8, help="remote: sequences per HTTP request")
    p.add_argument("--concurrency", type=int, default=4, help="remote: HTTP requests in flight")
    p.add_argument("--timeout-s", type=float, default=900, help="remote: per-request timeout")
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


def bench_inprocess(model_dir, seqs, ks, repeats) -> list[dict]:
    from vllm import LLM

    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_logprobs=max(ks), max_model_len=max(map(len, seqs)) + 8)
    tokens = sum(map(len, seqs))
    rows = []
    for k in tqdm(ks, desc="in-process"):
        teacher = VllmTeacher(llm, VllmTeacherConfig(k=k))
        t = timed(lambda: teacher.score(seqs), repeats)
        rows.append({"path": "in-process", "k": k, **t, "tokens_per_s": tokens / t["seconds"]})
        print(json.dumps(rows[-1]), flush=True)  # partial results survive an interrupted run
    llm.llm_engine.engine_core.shutdown()
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_remote(model_dir, seqs, ks, repeats, batch_size, concurrency, timeout_s,
                 log_path, output: str = "topk") -> list[dict]:
    from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher
    from opkd_mcore.teacher.serve import TeacherServer, TeacherServerConfig

    cfg = TeacherServerConfig(model=model_dir, k=max(ks), port=_free_port(), dtype="float32",
                              max_model_len=max(map(len, seqs)) + 8, output=output)
    tokens = sum(map(len, seqs))
    rows = []
    with TeacherServer(cfg, log_path=log_path) as server:
        server.wait_ready(timeout_s=900)
        for k in tqdm(ks if output == "topk" else [None], desc=f"remote {output}"):
            client = RemoteVllmTeacher(RemoteTeacherConfig(
                url=server.url, k=k or 1, batch_size=batch_size, max_concurrency=concurrency,
                timeout_s=timeout_s, max_retries=0, output=output))
            client.score(seqs[:1])  # server check + warm-up, not counted
            before = client.stats["wire_bytes"]
            t = timed(lambda: client.score(seqs), repeats)
            s = client.stats
            client_s = s["http_s"] + s["json_decode_s"] + s["parse_s"]
            rows.append({"path": "remote" if output == "topk" else "remote-hidden", "k": k, **t,
                         "tokens_per_s": tokens / t["seconds"],
                         "bytes_per_token": (s["wire_bytes"] - before) / (tokens * (repeats + 1)),
                         "json_decode_share": s["json_decode_s"] / client_s,
                         "rows_to_tensors_share": s["parse_s"] / client_s})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(tmp)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        seqs = make_sequences(args.num_seqs, args.seq_len, vocab)
        rows = []
        if not args.skip_inprocess:
            rows += bench_inprocess(model_dir, seqs, ks, args.repeats)
        if not args.skip_remote:
            rows += bench_remote(model_dir, seqs, ks, args.repeats, args.batch_size, args.concurrency,
                                 args.timeout_s, os.path.join(tmp, "server.log"))
            if args.hidden:
                rows += bench_remote(model_dir, seqs, ks, args.repeats, args.batch_size, args.concurrency,
                                     args.timeout_s, os.path.join(tmp, "server_hidden.log"), output="hidden")
    meta = run_metadata(cpus=os.cpu_count(), num_seqs=args.num_seqs, seq_len=args.seq_len, vocab=vocab,
                        model=args.model or "tiny qwen3 (vocab 1024, hidden 256, 2 layers)")
    print(f"{'path':<13} {'k':>6} {'tokens/s':>10} {'s/call':>8} {'B/token':>8} {'json share':>10} "
          f"{'rows share':>10}")
    for r in rows:
        share = f"{r['json_decode_share']:.1%}" if "json_decode_share" in r else "-"
        parse = f"{r['rows_to_tensors_share']:.1%}" if "rows_to_tensors_share" in r else "-"
        wire = f"{r['bytes_per_token']:.0f}" if "bytes_per_token" in r else "-"
        k = "hidden" if r["k"] is None else r["k"]
        print(f"{r['path']:<13} {k:>6} {r['tokens_per_s']:>10.0f} {r['seconds']:>8.3f} {wire:>8} {share:>10} "
              f"{parse:>10}")
    record(args.results, meta, rows, table=False)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
