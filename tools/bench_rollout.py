"""Rollout generate time of one vLLM engine: in this process vs inside a Ray actor, sleep mode off/on.

    python tools/bench_rollout.py --model /tmp/models/qwen3-0.6b [--prompts 32 --n 4 --max-new-tokens 256]
        [--modes inprocess,inprocess_sleep,ray_sleep] [--json out.json] [--results runs.jsonl]

The engine alone, apart from the rest of a step: whether it generates slower inside the Ray
controller's rollout actor than in the trainer's process, and what sleep mode or CUDA graphs
(`--cuda-graphs`) cost. The same `build_rollout` the trainer and the controller's rollout actors
use, the same seeded batch, timed per `generate` call (the first call of each mode warms up). The Ray
mode reserves what the controller's colocated rollout actor reserves (`controller.cpus_per_worker`
CPUs, a share of the device), and runs as a threaded actor as the controller's does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import add_results_argument, percentiles, record, run_metadata  # noqa: E402

MODES = ("inprocess", "inprocess_sleep", "ray_sleep")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint of the student")
    p.add_argument("--prompts", type=int, default=32, help="prompts per generate call")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--calls", type=int, default=3, help="generate calls per mode (the first warms up)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2, help="the engine's device share")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture CUDA graphs (rollout.enforce_eager=false); default: eager, as configured")
    p.add_argument("--json", help="write the results here")
    add_results_argument(p)
    return p.parse_args(argv)


def generate_times(model: str, sleep: bool, prompts: int, n: int, max_new: int, calls: int,
                   memory: float, eager: bool = True) -> dict:
    """Seconds of each `generate` call of one engine (a sleep/wake cycle before the last when `sleep`).
    Timed by hand, not by `bench_common.time_it`: this runs inside a Ray actor too, whose worker process
    cannot import modules from tools/ (the driver reduces the seconds to percentiles)."""
    import torch
    from transformers import AutoConfig

    from opkd_mcore.config import load_config
    from opkd_mcore.rollout.config import SamplingConfig
    from opkd_mcore.train.components import build_rollout

    cfg = load_config(None, [f"model.student={model}", "model.params_dtype=bfloat16",
                             f"rollout.max_model_len={max_new + 64}",
                             f"rollout.gpu_memory_utilization={memory}",
                             f"rollout.enforce_eager={str(eager).lower()}"], validate=False)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    engine = build_rollout(cfg, sleep_mode=sleep)
    batch = [[1 + (7 * i + j) % (vocab - 1) for j in range(5)] for i in range(prompts)]  # distinct prompts
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


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {MODES}")
        run_args = (args.model, mode.endswith("_sleep"), args.prompts, args.n, args.max_new_tokens,
                    args.calls, args.gpu_memory_utilization, not args.cuda_graphs)
        results[mode] = (in_ray_actor(run_args, args.gpu_memory_utilization) if mode.startswith("ray")
                         else generate_times(*run_args))
        print(f"{mode}: seconds per call {results[mode]['seconds']}", flush=True)
    rows = []
    for mode, r in results.items():
        later = percentiles(r["seconds"][1:] or r["seconds"])  # the first call warms the engine up
        r.update(later_s=later["p50"], later_s_p20=later["p20"], later_s_p80=later["p80"])
        rows.append({"mode": mode, "tokens per call": r["tokens"], "first call s": round(r["seconds"][0], 2),
                     "later calls s (p50)": round(later["p50"], 2),
                     "p20-p80 s": f"{later['p20']:.2f}-{later['p80']:.2f}",
                     "tokens/s": round(r["tokens"] / later["p50"]),
                     "OMP threads": f"{r['omp_num_threads']} / {r['torch_threads']}"})
    meta = run_metadata()
    record(args.results, meta, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "rollout", "results": results, "args": vars(args), "meta": meta}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
