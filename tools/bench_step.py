"""Step time of the four schedules on one workload, side by side: sync, one_step_off, two_step_off, async.

    python tools/bench_step.py [--steps 8] [--prompts 8] [--n 2] [--max-new-tokens 32] [--json out.json]
        [--results runs.jsonl]
    opkd bench step --student DIR --teacher DIR --engines 1 --teachers-with-rollout   (a GPU box)
    opkd bench step --config configs/gpu_qwen3_8b_from_32b_ray_x8.yaml --out DIR --steps 4   (a run's YAML)

One Ray cluster and one set of actors (trainer ranks, rollout engines, teacher) serve every schedule:
each run starts from the same initial student (`RayController(groups=...)` resets the trainer), so
only the schedule differs. Printed per schedule: medians over the steps after the first (the first
warms the engines up; the step time's p20 / p80 too) of the step time, of each stage (rollout /
teacher per engine or teacher actor, train, weight sync), their sum, `perf/overlap` = 1 - step / sum,
the waits, and the largest staleness. An overlapped schedule shows a step shorter than the sum of its stages.

Without --student/--teacher it builds tiny random models (a CPU run, the defaults); with them it uses
those checkpoints. With --config it runs that file's models, layout and workload instead (the shape
options above are refused: a file's value is changed by an override such as `rollout.n=4`), and each
schedule keeps its run directory's metrics.jsonl (`--out DIR`: DIR/<schedule>). This script simplifies
nothing in the controller: it is `opkd train` with `controller.kind=ray`, minus checkpoints (and, without
--config, metrics files).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

from bench_common import add_results_argument, choices_list, percentiles, record, run_metadata  # noqa: E402

SCHEDULES = ("sync", "one_step_off", "two_step_off", "async")
COLUMNS = (("step", "timing/step"), ("rollout", "timing/rollout"), ("teacher", "timing/teacher"),
           ("train", "timing/train"), ("sync", "timing/weight_sync"), ("wait_roll", "timing/wait_rollout"),
           ("wait_teach", "timing/wait_teacher"), ("wait_train", "timing/wait_train"),
           ("train_pack", "timing/train_pack"), ("fetch", "timing/teacher_fetch"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="steps per schedule (the first is not counted)")
    p.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_step")
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response length cap")
    p.add_argument("--micro-batch", type=int, default=4, help="parallel.micro_batch_size")
    p.add_argument("--params-dtype", default="float32",
                   help="model.params_dtype: the student's training and rollout dtype (bfloat16 on GPUs, "
                        "as configs/gpu_qwen3_0.6b_from_1.7b.yaml)")
    p.add_argument("--engines", type=int, default=1, help="rollout engines")
    p.add_argument("--tp", type=int, default=1, help="trainer tensor-parallel size (= trainer ranks)")
    p.add_argument("--max-staleness", type=int, default=1, help="async: run.max_staleness")
    p.add_argument("--student", help="student HF checkpoint (default: a tiny random model)")
    p.add_argument("--teacher", help="teacher HF checkpoint (default: a tiny random model)")
    p.add_argument("--teacher-backend", default="hf", help="teacher backend: hf | vllm")
    p.add_argument("--hidden", type=int, default=256, help="tiny models: hidden size")
    p.add_argument("--layers", type=int, default=4, help="tiny models: layers")
    p.add_argument("--teachers-with-rollout", action="store_true",
                   help="the teacher shares the rollout engine's device (2 GPUs: student | rollout+teacher)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each vLLM engine's share")
    p.add_argument("--schedules", type=choices_list(SCHEDULES), default=",".join(SCHEDULES),
                   help="comma-separated run.schedule values (colocated placement admits only sync)")
    p.add_argument("--config", help="a run's YAML (controller.kind ray): its models, layout and workload "
                                    "instead of the shape options above, which are then refused")
    p.add_argument("--out", help="root of the schedules' run directories, DIR/<schedule> (default: a new "
                                 "temporary directory)")
    p.add_argument("--json", help="write the results here")
    add_results_argument(p)
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = p.parse_args(argv)
    if args.config:
        given = [f"--{dest.replace('_', '-')}" for dest in CONFIG_SETS
                 if getattr(args, dest) != p.get_default(dest)]
        if given:
            p.error(f"{', '.join(given)}: --config {args.config} sets the workload; change it with an "
                    "override (e.g. rollout.n=4 parallel.tp=2) instead")
    return args


# what a --config file sets instead of these options
CONFIG_SETS = ("prompts", "n", "max_new_tokens", "micro_batch", "params_dtype", "engines", "tp",
               "max_staleness", "student", "teacher", "teacher_backend", "hidden", "layers",
               "teachers_with_rollout", "gpu_memory_utilization")


def tiny_models(root: str, hidden: int, layers: int) -> tuple[str, str]:
    from opkd_mcore.data import ALPHABET
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    shape = TinyModelShape(vocab_size=32, hidden_size=hidden, num_layers=layers, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=128)
    return (save_tiny_hf_model(os.path.join(root, "student"), "qwen3", shape, seed=1, alphabet=ALPHABET),
            save_tiny_hf_model(os.path.join(root, "teacher"), "qwen3", shape, seed=2, alphabet=ALPHABET,
                               init_std=0.1))


def file_overrides(args, out: str) -> list[str]:
    """--config: the bench's own settings over the file's (steps, no checkpoints, quiet console)."""
    return [f"run.steps={args.steps}", f"run.output_dir={out}", "controller.kind=ray",
            "logging.progress_bar=false", "logging.console_every=0", "checkpoint.save_at_end=false",
            "checkpoint.export_hf_at_end=false", *args.overrides]


def config_overrides(args, student: str, teacher: str, out: str) -> list[str]:
    return [
        f"model.student={student}", f"model.params_dtype={args.params_dtype}",
        f"teacher.teachers.0.model={teacher}",
        f"teacher.teachers.0.backend={args.teacher_backend}", "teacher.teachers.0.top_k=8",
        "loss.support=teacher", f"parallel.tp={args.tp}", f"parallel.micro_batch_size={args.micro_batch}",
        f"parallel.global_batch_size={args.prompts * args.n}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_model_len={max(128, args.max_new_tokens + 64)}",   # prompts are < 64 tokens
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}", "data.num_train=512",
        "logging.progress_bar=false", "logging.console_every=0", "logging.jsonl=false",
        "checkpoint.save_at_end=false", "checkpoint.export_hf_at_end=false", f"run.steps={args.steps}",
        f"run.output_dir={out}", "controller.kind=ray",
        f"controller.rollout_engines={args.engines}",
        f"controller.teachers_with_rollout={str(args.teachers_with_rollout).lower()}",
        f"run.max_staleness={args.max_staleness}", *args.overrides]


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return percentiles(values)["p50"] if values else math.nan


def summarize(history: list[dict]) -> dict:
    rows = history[1:] or history  # the first step warms the engines up
    out = {name: _median(rows, key) for name, key in COLUMNS}
    step = percentiles(r["timing/step"] for r in rows)
    out.update(step_p20=step["p20"], step_p80=step["p80"])
    out["sum_of_stages"] = out["rollout"] + out["teacher"] + out["train"] + out["sync"]
    out["overlap"] = _median(rows, "perf/overlap")
    out["staleness_max"] = max(r["async/staleness_max"] for r in history)
    out["dropped"] = sum(r["async/dropped"] for r in history)
    out["loss_last"] = history[-1]["train/loss"]
    # every step's timings too: a median hides a stage that is slow only now and then
    out["per_step"] = [{key: r.get(key) for _, key in COLUMNS} for r in history]
    return out


def _write_json(args, results: dict, startup_s: float, meta: dict) -> None:
    if not args.json:
        return
    out = {"bench": "step", "results": results, "args": vars(args), "startup_s": startup_s, "meta": meta}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)


def main(argv=None) -> int:
    import logging

    import ray

    from opkd_mcore.config import launch_world_size, load_config
    from opkd_mcore.controller import RayController, WorkerGroups
    from opkd_mcore.controller.placement import cpus_needed

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    root = args.out or tempfile.mkdtemp(prefix="bench_step_")
    if args.config:
        base = file_overrides(args, os.path.join(root, "run"))
    else:
        student, teacher = args.student, args.teacher
        if not (student and teacher):
            student, teacher = tiny_models(root, args.hidden, args.layers)
        base = config_overrides(args, student, teacher, os.path.join(root, "run"))
    cfg = load_config(args.config, base)
    start = time.perf_counter()
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             num_cpus=max(os.cpu_count() or 1, int(cpus_needed(cfg, launch_world_size(cfg)) + 1)))
    results, meta = {}, run_metadata()
    header = ["schedule", *[n for n, _ in COLUMNS], "sum_of_stages", "overlap", "staleness_max", "dropped"]
    print(" | ".join(f"{h:>13}" for h in header), flush=True)
    try:
        groups = WorkerGroups(cfg, launch_world_size(cfg))
        startup_s = time.perf_counter() - start
        for schedule in args.schedules:
            run_cfg = load_config(args.config, base + [f"run.schedule={schedule}",
                                                       f"run.output_dir={os.path.join(root, schedule)}"])
            history = RayController(run_cfg, groups=groups).run()
            results[schedule] = r = summarize(history)
            # each schedule's row and the JSON as soon as it is done: a later schedule that hangs
            # (a time limit on a lent machine) keeps the earlier ones
            cells = [schedule] + [f"{r[h]:.3f}" for h in header[1:-2]] + [f"{r['staleness_max']:.0f}",
                                                                           f"{r['dropped']:.0f}"]
            print(" | ".join(f"{c:>13}" for c in cells), flush=True)
            _write_json(args, results, startup_s, meta)
        groups.shutdown()
    finally:
        ray.shutdown()
    summary = [{"schedule": name, **{k: v for k, v in r.items() if k != "per_step"}}
               for name, r in results.items()]
    record(args.results, {**meta, "startup_s": startup_s}, summary, table=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
