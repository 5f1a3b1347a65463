"""The distillation loss inside a real training step: time, peak memory, and its share of the step.

A Qwen3-shaped student (random weights, bf16, `MegatronEngine` with Adam) takes optimizer steps on
one packed micro-batch of `--tokens` response tokens through the trainer's own objective
(`train/objective.py`), once with `loss.impl=fused` (Triton) and once with `reference` (torch),
against a top-k teacher (`--k`) or a dense one (`--k 0`). Beside each step, the loss alone
(forward + backward on logits of the same shape) is timed, so the table shows the loss's share of
the step; the peak memory above the model's resident state shows whether the loss adds `[N, V]`
float32 temporaries (a bf16 logits buffer of the batch is printed for scale).

    python tools/bench_train_step.py --shape qwen3-0.6b --tokens 8192 --k 64 --out step.json
    torchrun --nproc-per-node 2 tools/bench_train_step.py --shape qwen3-1.7b --tp 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import add_results_argument, record, run_metadata, time_it  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="a name in opkd_mcore.models.tiny.NAMED_SHAPES")
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch (all scored)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per packed sequence")
    p.add_argument("--k", type=int, default=64, help="teacher top-k width; 0 = dense teacher logits")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: world size)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per implementation")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    add_results_argument(p)
    return p.parse_args(argv)


def _batch(args, vocab: int, v_local: int, tp_rank: int):
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.losses import DenseTeacher, TopKTeacher

    g = torch.Generator().manual_seed(0)
    n_seq = args.tokens // args.seq
    seqs = [torch.randint(3, vocab, (args.seq + 1,), generator=g).tolist() for _ in range(n_seq)]
    total = n_seq * (args.seq + 1)
    if args.k:
        logits = torch.randn(total, vocab, device="cuda")
        lp, ids = torch.log_softmax(logits, -1).topk(args.k, -1)
        teacher = TopKTeacher(ids=ids.cpu(), logprobs=lp.cpu())
        del logits
    else:
        teacher = DenseTeacher(logits=torch.randn(total, v_local, generator=g).to(torch.bfloat16))
    return pack_sequences(seqs, [1] * n_seq, teacher=teacher)


def _timed_steps(engine, batch, loss_fn, fused_lm_head: bool, iters: int):
    """Timing of `iters` optimizer steps after one warm-up, and the peak memory above the model's state."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    timing = time_it(lambda: engine.train_step([batch], loss_fn, fused_lm_head=fused_lm_head), 1, iters,
                     torch.cuda.synchronize)
    return timing, torch.cuda.max_memory_allocated() - base


def _loss_alone(batch, loss_fn, v_local: int, iters: int):
    """Forward + backward of the loss on bf16 logits of the step's shape (no model)."""
    logits = torch.randn(batch.num_tokens, v_local, device="cuda", dtype=torch.bfloat16)
    on_device = batch.to("cuda")   # outside the timed region: a dense teacher's logits are GBs
    out = []

    def fresh_logits():  # the gradient is written in place: every call needs its own copy
        z = logits.clone().requires_grad_()
        out[:] = [z * 1.0]  # a non-leaf, as the model's output is

    def loss_step():
        loss, _ = loss_fn(out[0], on_device)
        loss.backward()

    return time_it(loss_step, 1, iters, torch.cuda.synchronize, before_each=fresh_logits)


def main(argv=None) -> int:
    args = parse_args(argv)
    from opkd_mcore.config import LossSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.models import build_model
    from opkd_mcore.models.tiny import NAMED_SHAPES, make_char_tokenizer, tiny_hf_config
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.objective import StepCounts, make_loss_fn

    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_parallel(ParallelConfig(tp=args.tp or world))
    from megatron.core import parallel_state as ps

    hf_config = tiny_hf_config("qwen3", NAMED_SHAPES[args.shape], make_char_tokenizer("0123456789+="))
    chunks = build_model(hf_config, params_dtype=torch.bfloat16)
    engine = MegatronEngine(chunks, OptimSection(lr=1e-6))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    v_local = engine.padded_vocab_size // tp
    batch = _batch(args, hf_config.vocab_size, v_local, tp_rank)
    counts = StepCounts(num_tokens=batch.num_loss_tokens, num_seqs=batch.num_sequences)
    group = ps.get_tensor_model_parallel_group()
    rows = []
    for impl in ("fused", "reference"):
        loss = LossSection(impl=impl, support="teacher" if args.k else None)
        plan = resolve_loss_plan(loss, device=engine.device, dtype=engine.params_dtype,
                                 teacher_kind="topk" if args.k else "dense")
        loss_fn = make_loss_fn(plan, counts, group)
        step, peak = _timed_steps(engine, batch, loss_fn, plan.fused_lm_head, args.iters)
        alone = _loss_alone(batch, loss_fn, v_local, args.iters)
        rows.append(dict(impl=impl, **step.row("step_s"), **alone.row("loss_s"),
                         loss_share=round(alone.p50 / step.p50, 3), peak_above_model_gb=round(peak / 1e9, 2)))
    logits_gb = batch.num_tokens * v_local * 2 / 1e9
    meta = run_metadata(device=torch.cuda.get_device_name())
    result = dict(shape=args.shape, tokens=batch.num_tokens, k=args.k, tp=tp,
                  bf16_logits_gb=round(logits_gb, 2), rows=rows, meta=meta)
    if torch.distributed.get_rank() == 0:
        record(args.results, {**meta, "shape": args.shape, "tokens": batch.num_tokens, "k": args.k, "tp": tp},
               rows, table=False)
        teacher = f"top-{args.k}" if args.k else "dense"
        print(f"{args.shape}, {batch.num_tokens} tokens, teacher {teacher}, tp={tp}; "
              f"one bf16 logits buffer = {logits_gb:.2f} GB")
        print("| loss impl | step s | loss fwd+bwd s | loss share | peak above model GB |")
        print("| --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['impl']} | {r['step_s']} | {r['loss_s']} | {r['loss_share']:.0%} | "
                  f"{r['peak_above_model_gb']} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    destroy_parallel(destroy_process_group=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
