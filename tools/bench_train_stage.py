"""The product's train stage against the engine's packed step on the same tokens (one GPU).

`opkd train`'s step spends `timing/train` in `train/stages.py: train_stage`: the samples' teacher
rows padded and packed into micro-batches by token budget, then `MegatronEngine.train_step`. This
tool takes a step's worth of samples shaped like the GPU lane's run (`--seqs` sequences of a short
prompt and up to `--response` tokens, top-`--k` teacher rows on the host, as the vLLM teacher hands
them over, `--max-tokens` per micro-batch) on a student loaded from `--model`, and times, a row each:

* `stage_fresh`: `train_stage` on new samples every step (new lengths: what the product sees);
* `engine_fresh`: `engine.train_step` on new samples of the same shape statistics, drawn apart from
  `stage_fresh`'s (so neither row meets lengths the other has planned for) and packed before the clock;
* `stage_same`: `train_stage` on the same samples every step (the packing, fixed shapes);
* `engine`: `engine.train_step` on the same micro-batches, packed once (the engine's own step).

Each row starts from an emptied caching allocator, then takes `--warmup` steps on draws of its own
before the `--steps` it times, as a run's cache is warm after its first steps.
`stage_fresh - engine_fresh` (and `stage_same - engine`) is what the product adds to the engine: the
host's packing and copies; `engine_fresh - engine` is what new shapes cost the engine itself
(attention plans, allocator). `vs_engine` divides each row's seconds per token by its engine row's.
Beside each row: host syncs are not counted here (the CPU test
`tests/test_train_stage_syncs.py` does), but the caching allocator's device mallocs and retries and
Python's garbage collections during the timed steps are; the allocator's settings
(`PYTORCH_CUDA_ALLOC_CONF`) are recorded with the rows. `--profile` prints a torch profiler table
(CPU and CUDA time by op, top 25) of two steps of `stage_fresh` and of `engine`.

    python tools/bench_train_stage.py --model /tmp/models/qwen3-0.6b --profile --results results.jsonl
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import add_results_argument, record, run_metadata  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/models/qwen3-0.6b", help="HF checkpoint of the student")
    p.add_argument("--seqs", type=int, default=128, help="sequences per step (the lane: 32 prompts x 4)")
    p.add_argument("--response", type=int, default=256, help="longest response (responses: 75-100%% of it)")
    p.add_argument("--k", type=int, default=64, help="teacher top-k width")
    p.add_argument("--max-tokens", type=int, default=16384, help="parallel.max_tokens_per_micro_batch")
    p.add_argument("--steps", type=int, default=8, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row before its timed ones")
    p.add_argument("--profile", action="store_true", help="torch profiler tables of stage_fresh and engine")
    add_results_argument(p)
    return p.parse_args(argv)


def scored_batch(seed: int, args, vocab: int):
    """A step of samples: prompts of 16-23 tokens, responses of 75-100% of `--response`, top-k rows
    (distinct ids, log-softmax values) on the host in the teacher's dtypes (int64, float32)."""
    from opkd_mcore.losses import TopKTeacher
    from opkd_mcore.rollout import Sample
    from opkd_mcore.train.stages import ScoredBatch

    g = torch.Generator().manual_seed(seed)
    samples, rows = [], []
    for i in range(args.seqs):
        prompt = torch.randint(3, vocab, (16 + int(torch.randint(0, 8, (1,), generator=g)),), generator=g)
        n = int(torch.randint(args.response * 3 // 4, args.response + 1, (1,), generator=g))
        response = torch.randint(3, vocab, (n,), generator=g)
        samples.append(Sample(prompt_ids=prompt.tolist(), response_ids=response.tolist(),
                              response_logprobs=None, finish_reason="length", weight_version=0,
                              group_id=i // 4))
        logits = torch.randn(len(prompt) + n - 1, vocab, device="cuda")
        lp, ids = torch.log_softmax(logits, -1).topk(args.k, -1)
        rows.append(TopKTeacher(ids=ids.cpu(), logprobs=lp.cpu()))
    return ScoredBatch(samples=samples, teacher=rows)


def sample_tokens(scored) -> int:
    """Prompt and response tokens of a step's samples."""
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in scored.samples)


class _GcClock:
    """Python garbage collections (count, seconds) while it is on."""

    def __init__(self):
        self.count, self.seconds, self._start = 0, 0.0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def timed(name: str, step, steps: int, warmup: int) -> dict:
    """`warmup` untimed calls of `step(i)` (i < 0), then `steps` timed ones (device drained around
    each); `step` returns the tokens it trained on. Each row starts with the caching allocator emptied,
    so the rows meet new shapes equally cold."""
    gc.collect()
    torch.cuda.empty_cache()
    for i in range(-warmup, 0):
        step(i)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    seconds, per_token = [], []
    with _GcClock() as clock:
        for i in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = step(i)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            per_token.append(seconds[-1] / tokens)
    after = torch.cuda.memory_stats()
    seconds.sort()
    return {"row": name, "p50_s": round(seconds[len(seconds) // 2], 4), "min_s": round(seconds[0], 4),
            "max_s": round(seconds[-1], 4),
            "us_per_token": round(1e6 * sorted(per_token)[len(per_token) // 2], 3),
            "device_mallocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
            "alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
            "gc_runs": clock.count,
            "gc_s": round(clock.seconds, 4)}


def profile_table(name: str, step, first: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + 2):
            step(i)
        torch.cuda.synchronize()
    print(f"\n## torch profiler: {name}, 2 steps, top 25 by CPU time (self)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"\n## torch profiler: {name}, 2 steps, top 25 by CUDA time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.objective import make_loss_fn
    from opkd_mcore.train.stages import pack_micro_batches, train_stage

    init_parallel(ParallelConfig())
    engine, _ = build_student(args.model, OptimSection(lr=1e-5, clip_grad=1.0), params_dtype="bfloat16")
    vocab = engine.vocab_size
    plan = resolve_loss_plan(LossSection(support="teacher"), device=engine.device, dtype=engine.params_dtype,
                             teacher_kind="topk")
    par = ParallelSection(micro_batch_size=16, global_batch_size=args.seqs,
                          max_tokens_per_micro_batch=args.max_tokens)
    shard, group = shard_layout(engine), ps.get_tensor_model_parallel_group()
    # each fresh row's own draws: its warm-up steps (i < 0), its timed ones, then two the profiler sees
    # first (new shapes there too)
    span = range(-args.warmup, args.steps + 2)
    stage_draws = {i: scored_batch(1 + args.warmup + i, args, vocab) for i in span}
    engine_draws = {i: scored_batch(10_001 + args.warmup + i, args, vocab) for i in span}
    engine_packed = {i: pack_micro_batches(b, par, shard) for i, b in engine_draws.items()}
    same = scored_batch(0, args, vocab)
    batches, counts = pack_micro_batches(same, par, shard)

    def engine_on(packed, tokens):
        step_batches, step_counts = packed
        engine.train_step(step_batches, make_loss_fn(plan, step_counts, group),
                          fused_lm_head=plan.fused_lm_head)
        return tokens

    def stage_fresh(i):
        train_stage(engine, stage_draws[i], plan, par, shard, group)
        return sample_tokens(stage_draws[i])

    def engine_fresh(i):
        return engine_on(engine_packed[i], sample_tokens(engine_draws[i]))

    def stage_same(i):
        train_stage(engine, same, plan, par, shard, group)
        return sample_tokens(same)

    def engine_step(i):
        return engine_on((batches, counts), sample_tokens(same))

    rows = [timed(name, step, args.steps, args.warmup) for name, step in
            (("stage_fresh", stage_fresh), ("engine_fresh", engine_fresh), ("stage_same", stage_same),
             ("engine", engine_step))]
    for r, base in zip(rows, (rows[1], rows[1], rows[3], rows[3])):
        r["vs_engine"] = round(r["us_per_token"] / base["us_per_token"], 3)
    tokens = sum(b.num_tokens for b in batches)
    meta = run_metadata(device=torch.cuda.get_device_name(), seqs=args.seqs, response=args.response,
                        k=args.k, max_tokens=args.max_tokens, tokens=tokens, micro_batches=len(batches),
                        plan=plan.describe(), alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    print(f"{tokens} tokens in {len(batches)} micro-batches ({[b.num_tokens for b in batches]}), "
          f"{plan.describe()}")
    record(args.results, meta, rows)
    if args.profile:
        profile_table("stage_fresh", stage_fresh, args.steps)
        profile_table("engine", engine_step, args.steps)
    destroy_parallel(destroy_process_group=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
