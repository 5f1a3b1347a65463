"""The distillation loss inside a real training step: time, peak memory, and its share of the step.

A Qwen3-shaped student (random weights, bf16, `MegatronEngine` with Adam) takes optimizer steps on
one packed micro-batch of `--tokens` response tokens through the trainer's own objective
(`train/objective.py`), once with `loss.impl=fused` (Triton) and once with `reference` (torch),
against a top-k teacher (`--k`) or a dense one (`--k 0`). Beside each step, the loss alone
(forward + backward on logits of the same shape) is timed, so the table shows the loss's share of
the step; the peak memory above the model's resident state shows whether the loss adds `[N, V]`
float32 temporaries (a bf16 logits buffer of the batch is printed for scale).

Long responses and the memory levers: `--seq-len N` makes the micro-batch one sequence of N tokens
(a 1-token prompt and an N-1-token response), `--cp` splits it over context-parallel ranks
(Transformer Engine), `--sequence-parallel` (TE, tp > 1) and `--recompute none|selective|full` set the
student's options as `parallel.*` does; the peak column then shows the memory each one saves and the
step column what it costs. A layout that cannot run (no TE, ranks that do not divide) is refused on
every rank before any process group forms, so the command exits instead of hanging.

    python tools/bench_train_step.py --shape qwen3-0.6b --tokens 8192 --k 64 --out step.json
    torchrun --nproc-per-node 2 tools/bench_train_step.py --shape qwen3-1.7b --tp 2
    torchrun --nproc-per-node 2 tools/bench_train_step.py --cp 2 --seq-len 32768 --impls fused
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import add_results_argument, choices_list, fusions_chosen, record, run_metadata, time_it  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="a name in opkd_mcore.models.tiny.NAMED_SHAPES")
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch (all scored)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per packed sequence")
    p.add_argument("--k", type=int, default=64, help="teacher top-k width; 0 = dense teacher logits")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: world size / cp)")
    p.add_argument("--cp", type=int, default=1, help="context parallel size (needs Transformer Engine)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="one sequence of this many tokens instead of --tokens / --seq (a long response)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recompute of the student (parallel.recompute)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism (parallel.sequence_parallel; TE and tp > 1)")
    p.add_argument("--fusions", default="auto", choices=("auto", "on", "off"),
                   help="Megatron's fused SwiGLU and fused RoPE (TE's kernel): auto = as opkd builds the "
                        "model (on where Transformer Engine builds it, models.builder.kernel_fusions)")
    p.add_argument("--impls", type=choices_list(("fused", "reference")), default="fused,reference",
                   help="loss implementations to time, comma-separated (reference materialises fp32 logits)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per implementation")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    add_results_argument(p)
    return p.parse_args(argv)


def _batch(args, vocab: int, v_local: int, tp_rank: int):
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.losses import DenseTeacher, TopKTeacher

    g = torch.Generator().manual_seed(0)
    if args.seq_len:
        seqs = [torch.randint(3, vocab, (args.seq_len,), generator=g).tolist()]
    else:
        seqs = [torch.randint(3, vocab, (args.seq + 1,), generator=g).tolist()
                for _ in range(args.tokens // args.seq)]
    n_seq, total = len(seqs), sum(len(s) for s in seqs)
    if args.k:
        parts = []
        for start in range(0, total, 4096):  # [rows, V] float32 a block at a time: 64K rows would be 40 GB
            logits = torch.randn(min(4096, total - start), vocab, device="cuda")
            lp, ids = torch.log_softmax(logits, -1).topk(args.k, -1)
            parts.append((ids.cpu(), lp.cpu()))
        teacher = TopKTeacher(ids=torch.cat([i for i, _ in parts]), logprobs=torch.cat([v for _, v in parts]))
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
    peak = torch.cuda.max_memory_allocated()
    return timing, peak - base, peak


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


def check_layout(args, world: int) -> int:
    """The TP size of a runnable layout, or SystemExit naming the flag: every rank checks the same things
    before any process group forms, so a bad layout ends the command instead of hanging it."""
    from opkd_mcore.models.builder import transformer_engine_usable

    tp = args.tp or max(world // args.cp, 1)
    if args.cp < 1 or world % (tp * args.cp):
        raise SystemExit(f"--tp {tp} x --cp {args.cp} does not divide the {world} ranks "
                         "(torchrun --nproc-per-node)")
    if args.sequence_parallel and tp == 1:
        raise SystemExit("--sequence-parallel: needs tp > 1 (it splits the sequence over the TP ranks)")
    if (args.cp > 1 or args.sequence_parallel) and not transformer_engine_usable():
        raise SystemExit(f"--cp {args.cp} / --sequence-parallel: need Transformer Engine on a GPU "
                         "(the transformer_engine package was not found, or the device is the CPU)")
    return tp


def main(argv=None) -> int:
    args = parse_args(argv)
    from opkd_mcore.config import LossSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.context_parallel import shard_batch
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.models import build_model
    from opkd_mcore.models.builder import kernel_fusions, memory_overrides
    from opkd_mcore.models.tiny import NAMED_SHAPES, make_char_tokenizer, tiny_hf_config
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.objective import StepCounts, make_loss_fn

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = check_layout(args, world)
    init_parallel(ParallelConfig(tp=tp, cp=args.cp))
    from megatron.core import parallel_state as ps

    hf_config = tiny_hf_config("qwen3", NAMED_SHAPES[args.shape], make_char_tokenizer("0123456789+="))
    fused = fusions_chosen(args.fusions, "--fusions")
    chunks = build_model(hf_config, params_dtype=torch.bfloat16,
                         **memory_overrides(args.recompute, args.sequence_parallel), **kernel_fusions(fused))
    engine = MegatronEngine(chunks, OptimSection(lr=1e-6))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    v_local = engine.padded_vocab_size // tp
    batch = _batch(args, hf_config.vocab_size, v_local, tp_rank)
    counts = StepCounts(num_tokens=batch.num_loss_tokens, num_seqs=batch.num_sequences)
    group = ps.get_tensor_model_parallel_group()
    # the loss alone runs on this CP rank's share, as it does inside the step
    own = shard_batch(batch, args.cp, ps.get_context_parallel_rank()) if args.cp > 1 else batch
    rows = []
    for impl in args.impls:
        loss = LossSection(impl=impl, support="teacher" if args.k else None)
        plan = resolve_loss_plan(loss, device=engine.device, dtype=engine.params_dtype,
                                 teacher_kind="topk" if args.k else "dense")
        loss_fn = make_loss_fn(plan, counts, group)
        step, peak, peak_total = _timed_steps(engine, batch, loss_fn, plan.fused_lm_head, args.iters)
        alone = _loss_alone(own, loss_fn, v_local, args.iters)
        rows.append(dict(impl=impl, **step.row("step_s"), **alone.row("loss_s"),
                         loss_share=round(alone.p50 / step.p50, 3), peak_above_model_gb=round(peak / 1e9, 2),
                         peak_gb=round(peak_total / 1e9, 2)))
    logits_gb = own.num_tokens * v_local * 2 / 1e9
    layout = dict(tp=tp, cp=args.cp, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                  fusions=fused)
    meta = run_metadata(device=torch.cuda.get_device_name())
    result = dict(shape=args.shape, tokens=batch.num_tokens, k=args.k, **layout,
                  bf16_logits_gb=round(logits_gb, 2), rows=rows, meta=meta)
    if torch.distributed.get_rank() == 0:
        record(args.results, {**meta, "shape": args.shape, "tokens": batch.num_tokens, "k": args.k, **layout},
               rows, table=False)
        teacher = f"top-{args.k}" if args.k else "dense"
        print(f"{args.shape}, {batch.num_tokens} tokens in {batch.num_sequences} sequence(s), "
              f"teacher {teacher}, tp={tp} cp={args.cp} recompute={args.recompute} "
              f"sp={args.sequence_parallel} fusions={fused}; one bf16 logits buffer of a rank's rows "
              f"= {logits_gb:.2f} GB")
        print("| loss impl | step s | loss fwd+bwd s | loss share | peak above model GB | peak GB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['impl']} | {r['step_s']} | {r['loss_s']} | {r['loss_share']:.0%} | "
                  f"{r['peak_above_model_gb']} | {r['peak_gb']} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    destroy_parallel(destroy_process_group=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
