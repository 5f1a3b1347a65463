"""Rollout generate time of one vLLM engine: where it runs, sleep mode, and the rollout's engine modes
side by side with TRL's way of building vLLM.

    python tools/bench_rollout.py --model /tmp/models/qwen3-0.6b [--prompts 32 --n 4 --max-new-tokens 256]
        [--modes inprocess,inprocess_sleep,ray_sleep] [--cuda-graphs] [--json out.json] [--results runs.jsonl]
    python tools/bench_rollout.py --model /tmp/models/qwen3-0.6b --modes ab --cuda-graphs   # the A/B set

The engine alone, apart from the rest of a step, the same seeded batch, timed per `generate` call (the
first call of each mode warms up). Modes:

  inprocess, inprocess_sleep  the trainer's `build_rollout` in this process (sleep mode off / on, a
                              sleep/wake cycle before the last call)
  ray_sleep                   the same inside a threaded Ray actor reserving what the controller's
                              colocated rollout actor reserves (`controller.cpus_per_worker` CPUs, a
                              share of the device)

and the A/B set (`--modes ab`), each in a fresh process of its own, one engine at a time:

  opkd                    `build_rollout` as `opkd train` builds it: a seeded request per sample, the
                          engine core in a process of its own, no detokenizing
  opkd_detokenize         the same, vLLM also decoding every response to text (the former default)
  engine_seeds            rollout.sample_seeds=engine: a prompt's n samples are one request drawn
                          from the engine's stream (one noise kernel per decode step, not one per request)
  core_in_process         rollout.engine_in_process: engine core and worker in this process
  engine_seeds_in_process both
  v2_runner               `opkd`, with VLLM_USE_V2_MODEL_RUNNER=1 (vLLM's batched per-request seeds)
  trl                     a plain `vllm.LLM` built as TRL 1.16's colocated generation builds it
                          (`trl/generation/vllm_generation.py`: external_launcher, max_num_batched_tokens
                          4096, processed logprobs, engine seed, prompts repeated n times as token ids,
                          n=1, detokenizing, use_tqdm off) for its GRPO trainer: logprobs=0, their
                          extraction timed too
  trl_kd                  the same engine as TRL's DistillationTrainer asks it (the `trl` runner of
                          `opkd bench peers`): no logprobs (logprobs=None), max_num_seqs = the batch,
                          min_tokens = max_tokens
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import add_results_argument, percentiles, record, run_metadata  # noqa: E402

# mode -> how its engine differs from `build_rollout` of the GPU config's rollout settings
MODES = {
    "inprocess": {},
    "inprocess_sleep": {"sleep": True},
    "ray_sleep": {"sleep": True, "ray": True},
    "opkd": {"child": True},
    "opkd_detokenize": {"child": True, "detokenize": True},
    "engine_seeds": {"child": True, "overrides": ["rollout.sample_seeds=engine"]},
    "core_in_process": {"child": True, "overrides": ["rollout.engine_in_process=true"]},
    "engine_seeds_in_process": {"child": True, "overrides": ["rollout.sample_seeds=engine",
                                                             "rollout.engine_in_process=true"]},
    # optional: a vLLM without the V2 runner for this platform refuses it (the row says so)
    "v2_runner": {"child": True, "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "optional": True},
    "trl": {"child": True, "trl": True},
    "trl_kd": {"child": True, "trl": True, "distillation": True},
}
AB_MODES = ("trl", "trl_kd", "opkd", "opkd_detokenize", "engine_seeds", "core_in_process",
            "engine_seeds_in_process", "v2_runner")
CHILD_MARK = "BENCH_ROLLOUT_CHILD "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint of the student")
    p.add_argument("--prompts", type=int, default=32, help="prompts per generate call")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--calls", type=int, default=3, help="generate calls per mode (the first warms up)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2, help="the engine's device share")
    p.add_argument("--modes", default="inprocess,inprocess_sleep,ray_sleep",
                   help=f"comma-separated, of {tuple(MODES)}; `ab` = {','.join(AB_MODES)}")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture CUDA graphs (rollout.enforce_eager=false); default: eager, as configured")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one A/B mode, in a process of its own
    p.add_argument("--json", help="write the results here")
    add_results_argument(p)
    return p.parse_args(argv)


def prompt_batch(model: str, prompts: int) -> list[list[int]]:
    """Distinct 5-token prompts (the same for every mode)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    return [[1 + (7 * i + j) % (vocab - 1) for j in range(5)] for i in range(prompts)]


def generate_times(model: str, mode: str, prompts: int, n: int, max_new: int, calls: int,
                   memory: float, eager: bool = True) -> dict:
    """Seconds of each `generate` call of one engine (a sleep/wake cycle before the last when the mode
    sleeps). Timed by hand, not by `bench_common.time_it`: this runs inside a Ray actor too, whose worker
    process cannot import modules from tools/ (the driver reduces the seconds to percentiles)."""
    import torch

    from opkd_mcore.config import load_config
    from opkd_mcore.rollout.config import SamplingConfig
    from opkd_mcore.train.components import build_rollout

    spec = MODES[mode]
    sleep = spec.get("sleep", False)
    cfg = load_config(None, [f"model.student={model}", "model.params_dtype=bfloat16",
                             f"rollout.max_model_len={max_new + 64}",
                             f"rollout.gpu_memory_utilization={memory}",
                             f"rollout.enforce_eager={str(eager).lower()}", *spec.get("overrides", [])],
                      validate=False)
    engine = build_rollout(cfg, sleep_mode=sleep)
    engine.cfg.detokenize = spec.get("detokenize", False)
    batch = prompt_batch(model, prompts)
    sampling = SamplingConfig(n=n, max_new_tokens=max_new)
    seconds, tokens = [], 0
    try:
        for call in range(calls):
            if sleep and call == calls - 1:
                engine.sleep()
                engine.wake_up()
            start = time.perf_counter()
            samples = engine.generate(batch, sampling, seeds=list(range(prompts)))
            seconds.append(time.perf_counter() - start)
            tokens = sum(len(s.response_ids) for s in samples)
    finally:
        engine.shutdown()
    return {"seconds": seconds, "tokens": tokens, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads()}


def trl_generate_times(model: str, prompts: int, n: int, max_new: int, calls: int, memory: float,
                       eager: bool = True, distillation: bool = False) -> dict:
    """The same batch through a `vllm.LLM` configured as TRL 1.16's colocated `VLLMGeneration` builds it
    (its own process: external_launcher sets this process's torch.distributed world and vLLM's mode).
    `distillation`: as its DistillationTrainer asks (distillation_trainer.py:806, 819: max_num_seqs = the
    generation batch, no logprobs; `opkd bench peers` passes min_tokens = max_tokens), else as GRPO."""
    import torch
    from vllm import LLM, SamplingParams

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    llm = LLM(model=model, tensor_parallel_size=1, gpu_memory_utilization=memory, max_model_len=max_new + 64,
              max_num_seqs=prompts * n if distillation else None, enable_sleep_mode=False, model_impl="auto",
              distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096,
              logprobs_mode="processed_logprobs", quantization=None, trust_remote_code=False,
              enforce_eager=eager)
    asked = {"logprobs": None, "min_tokens": max_new} if distillation else {"logprobs": 0}
    params = SamplingParams(n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                            max_tokens=max_new, **asked)  # top_k 0: TRL's default, vLLM's "off"
    inputs = [{"prompt_token_ids": ids} for ids in prompt_batch(model, prompts) for _ in range(n)]
    seconds, tokens = [], 0
    for _ in range(calls):
        start = time.perf_counter()
        outputs = llm.generate(inputs, sampling_params=params, use_tqdm=False)
        completions = [o.token_ids for out in outputs for o in out.outputs]
        if not distillation:  # trl's extract_logprobs, less its NaN check
            logprobs = [[[v.logprob for _, v in sorted(lp.items(), key=lambda kv: kv[1].rank)]
                         for lp in o.logprobs] for out in outputs for o in out.outputs]
            assert len(logprobs) == len(completions)
        seconds.append(time.perf_counter() - start)
        tokens = sum(len(c) for c in completions)
    return {"seconds": seconds, "tokens": tokens, "dtype": str(llm.llm_engine.model_config.dtype),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads()}


def in_child(args, mode: str) -> dict:
    """One A/B mode in a fresh process (an engine core built in a process fixes vLLM's mode for it)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model,
           "--prompts", str(args.prompts), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
           "--calls", str(args.calls), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += ["--cuda-graphs"] if args.cuda_graphs else []
    env = {**os.environ, **MODES[mode].get("env", {})}
    run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(CHILD_MARK)]
    if run.returncode != 0 or not lines:
        return {"error": f"exit status {run.returncode} (its log is above)"}
    return json.loads(lines[-1][len(CHILD_MARK):])


class RolloutActor:
    def run(self, *args) -> dict:
        return generate_times(*args)


def in_ray_actor(run_args: tuple, device_share: float) -> dict:
    import ray

    from opkd_mcore.config.schema import ControllerSection
    from opkd_mcore.platform.ray_resources import ray_actor_resources

    ray.init(address="local", include_dashboard=False)
    try:
        options = {"num_cpus": ControllerSection().cpus_per_worker, "max_concurrency": 4,
                   **ray_actor_resources(None, device_share)}
        actor = ray.remote(**options)(RolloutActor).remote()
        return ray.get(actor.run.remote(*run_args))
    finally:
        ray.shutdown()


def run_mode(args, mode: str) -> dict:
    spec = MODES[mode]
    sizes = (args.prompts, args.n, args.max_new_tokens, args.calls, args.gpu_memory_utilization,
             not args.cuda_graphs)
    if args.child and spec.get("trl"):
        return trl_generate_times(args.model, *sizes, distillation=spec.get("distillation", False))
    if args.child:
        return generate_times(args.model, mode, *sizes)
    if spec.get("child"):
        return in_child(args, mode)
    if spec.get("ray"):
        return in_ray_actor((args.model, mode, *sizes), args.gpu_memory_utilization)
    return generate_times(args.model, mode, *sizes)


def table_rows(results: dict) -> list[dict]:
    """One row per mode; `÷ trl`: its seconds per call over the TRL-built engine's, when that ran."""
    for r in results.values():
        if "error" not in r:
            later = percentiles(r["seconds"][1:] or r["seconds"])  # the first call warms the engine up
            r.update(later_s=later["p50"], later_s_p20=later["p20"], later_s_p80=later["p80"])
    base = results.get("trl", {}).get("later_s")
    rows = []
    for mode, r in results.items():
        if "error" in r:
            rows.append({"mode": mode, "tokens per call": r["error"]})
            continue
        later = {"p20": r["later_s_p20"], "p50": r["later_s"], "p80": r["later_s_p80"]}
        rows.append({"mode": mode, "tokens per call": r["tokens"], "first call s": round(r["seconds"][0], 2),
                     "later calls s (p50)": round(later["p50"], 3),
                     "p20-p80 s": f"{later['p20']:.3f}-{later['p80']:.3f}",
                     "tokens/s": round(r["tokens"] / later["p50"]),
                     "s ÷ trl's": round(later["p50"] / base, 2) if base else "-",
                     "OMP threads": f"{r['omp_num_threads']} / {r['torch_threads']}"})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(CHILD_MARK + json.dumps(run_mode(args, args.child)), flush=True)
        return 0
    modes = AB_MODES if args.modes == "ab" else tuple(args.modes.split(","))
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {tuple(MODES)} (or `ab`)")
    results = {}
    for mode in modes:
        results[mode] = run_mode(args, mode)
        seconds = results[mode].get("seconds", results[mode].get("error"))
        print(f"{mode}: seconds per call {seconds}", flush=True)
    rows = table_rows(results)
    meta = run_metadata()
    record(args.results, meta, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "rollout", "results": results, "args": vars(args), "meta": meta}, f, indent=2)
    # a mode that failed is a failed benchmark (the table shows which), unless it is optional
    return 1 if any("error" in r and not MODES[m].get("optional") for m, r in results.items()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
