"""One on-policy distillation workload through `opkd train`, TRL, verl and a plain transformers step.

The workload (`Workload`, every field below) is defined once; each runner turns it into its trainer's
settings, runs it in its own processes (a peer's package is never imported into this one) and reports
per step: generation, teacher, train and weight-update seconds, the step's seconds, the response
tokens it trained on, peak memory per GPU, and the objective it computes. The table shows, per runner
and model pair, the medians after the warm-up steps (p20-p80), response tokens/s, and opkd's tokens/s
over each peer's.

    opkd bench peers --runners opkd,plain,trl,verl --pairs 0.6b:1.7b,1.7b:4b --teacher topk:64 --gpus 1 \\
        --make-models --results $OUT/results.jsonl

Runners (docs/benchmarks.md "Against other trainers" says what each does with 2 GPUs):
  opkd   `opkd train` from configs/gpu_qwen3_0.6b_from_1.7b.yaml with the workload's overrides; stages
         from its metrics.jsonl. 2 GPUs: controller.kind=ray, trainer | rollout + teacher.
  plain  tools/plain_step.py: the train stage alone in plain transformers + torch (the floor).
  trl    tools/bench_peers_trl.py in TRL's interpreter (--trl-python): DistillationTrainer, vLLM
         colocated (2 GPUs: `trl vllm-serve` on the second GPU).
  verl   tools/bench_peers_verl.py in verl's interpreter (--verl-python): verl.trainer.main_ppo with
         distillation, FSDP student, vLLM rollout, vLLM teacher server on its own GPU (needs 2 GPUs).

Response lengths: with `fixed_length` every response is exactly max_new_tokens where the trainer can
force it (plain: by construction; TRL: vLLM's min_tokens = max_new_tokens; verl: rollout.ignore_eos).
`opkd train` has no such option: the random-weight checkpoints almost never sample EOS (one id of
151936), so its responses run to max_new_tokens; every row reports the tokens actually trained on and
tokens/s divides those (TRL's: what its generate calls of the optimizer step returned, padding left out;
its notes say how many calls and sequences). A peer whose count differs from opkd's shows both, and its
notes say it did not do the same generation work.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, fields, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, beside this file

import bench_common  # noqa: E402
import torch  # noqa: E402
from bench_common import ROOT, choices_list, percentiles, print_table, record, run_metadata  # noqa: E402
from bench_peers_process import (  # noqa: E402
    GpuMemoryPeak,
    RunnerFailed,
    python_can_import,
    run_logged,
)

import opkd_mcore  # noqa: E402
from opkd_mcore.data.addition import AdditionTask  # noqa: E402
from opkd_mcore.train.metrics import read_jsonl  # noqa: E402

GPU_CONFIG = os.path.join(ROOT, "configs", "gpu_qwen3_0.6b_from_1.7b.yaml")
RUNNERS = ("opkd", "plain", "trl", "verl")
PAIR_SHAPES = {"0.6b": "qwen3-0.6b", "1.7b": "qwen3-1.7b", "4b": "qwen3-4b", "8b": "qwen3-8b"}


def _f(default, doc: str):
    return field(default=default, metadata={"help": doc})


@dataclass(frozen=True)
class Workload:
    """One on-policy distillation job, the same for every runner."""

    student: str = _f("/tmp/models/qwen3-0.6b", "student HF checkpoint (tools/make_model.py --shape ...)")
    teacher: str = _f("/tmp/models/qwen3-1.7b", "teacher HF checkpoint, same tokenizer as the student")
    prompts_per_step: int = _f(32, "prompts per step: the synthetic addition task of opkd_mcore.data")
    samples_per_prompt: int = _f(4, "responses sampled per prompt")
    task_digits: int = _f(3, "addition task: digits per operand")
    seed: int = _f(0, "prompt selection (and sampling) seed: every runner gets the same prompts in order")
    max_new_tokens: int = _f(256, "response length cap")
    fixed_length: bool = _f(True, "every response exactly max_new_tokens where the runner can force it")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(-1, "top-k sampling, -1 = off")
    teacher_kind: str = _f("topk", "topk: the teacher's top-k rows (vLLM) | dense: full logits in the step")
    teacher_top_k: int = _f(64, "K of a top-k teacher")
    steps: int = _f(5, "measured steps")
    warmup_steps: int = _f(1, "steps run first and left out of the table (compile, graph capture)")
    micro_batch_size: int = _f(16, "sequences per micro-batch (plain, TRL)")
    max_tokens_per_micro_batch: int = _f(16384, "token budget per micro-batch (opkd, verl's dynamic batch); "
                                                "0: micro_batch_size sequences per micro-batch")
    lr: float = _f(1e-5, "learning rate, constant")
    clip_grad: float = _f(1.0, "max global gradient norm")
    dtype: str = _f("bfloat16", "training and inference dtype (float32 on CPU)")
    gpus: int = _f(1, "GPUs per runner: 1 colocated, 2 disaggregated where the runner supports it")
    schedule: str = _f("sync", "opkd train's run.schedule (sync: on-policy as TRL; one_step_off: step n+1 "
                               "generated beside step n's training, as verl's one-step-off: samples one "
                               "weight version old; on 1 GPU under the Ray controller, colocated)")
    gpu_memory_utilization: float = _f(0.2, "each colocated vLLM engine's share of the GPU")
    max_model_len: int = _f(512, "vLLM context length (prompt + response)")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def validate(self) -> None:
        if self.teacher_kind not in ("topk", "dense"):
            raise ValueError(f"teacher_kind: expected topk or dense, got {self.teacher_kind!r}")
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "steps", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.schedule not in ("sync", "one_step_off"):
            raise ValueError(f"schedule: expected sync or one_step_off, got {self.schedule!r}")
        if self.warmup_steps < 0 or self.gpus not in (1, 2):
            raise ValueError(f"warmup_steps >= 0 and gpus in (1, 2) expected, got "
                             f"{self.warmup_steps} and {self.gpus}")

    def prompt_records(self) -> list[dict]:
        """The run's prompts in order: `prompts_per_step` per step, each step's its own."""
        count = self.prompts_per_step * self.total_steps
        train, _ = AdditionTask(self.task_digits).splits(count, 0, self.seed)
        return train

    @classmethod
    def from_json(cls, path: str) -> "Workload":
        with open(path) as f:
            return cls(**json.load(f))

    @staticmethod
    def describe() -> str:
        """Every field with its default and meaning: the --help epilog."""
        return "\n".join(f"  {f.name:<27} {f.default!s:<24} {f.metadata['help']}" for f in fields(Workload))


@dataclass
class StepRow:
    """One step of one runner. A stage a runner does not do, or cannot time apart, is None."""

    runner: str
    step: int
    warmup: bool
    step_s: float
    response_tokens: int
    objective: str
    generation_s: float | None = None
    teacher_s: float | None = None
    train_s: float | None = None
    weight_update_s: float | None = None
    generation_calls: int | None = None  # generate calls in the step, where the runner counts them
    peak_memory_gib: list[float] | None = None  # per GPU (or the host's peak RSS on a CPU run)
    memory_source: str = ""
    version: str = ""  # the trainer's package and version
    notes: str = ""


def write_rows(path: str, rows: list[StepRow]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(asdict(row)) + "\n")


def read_rows(path: str) -> list[StepRow]:
    names = {f.name for f in fields(StepRow)}
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            data = json.loads(line)
            unknown = set(data) - names
            if unknown:
                raise ValueError(f"{path}:{n}: unknown step-row keys {sorted(unknown)}")
            rows.append(StepRow(**data))
    return rows


def child_env(workload: Workload, physical_gpus: list[str]) -> dict:
    """The environment of a runner's processes: this tree importable, the runner's GPUs visible."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if physical_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(physical_gpus[:workload.gpus])
    return env


# ---------------------------------------------------------------------------------------------- opkd

def _num(x: float) -> str:
    """A number as the config loader's YAML reads it back as one (it takes `1e-05` for a string)."""
    text = f"{x:.12f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def opkd_overrides(w: Workload, run_dir: str, prompts_path: str, on_gpu: bool) -> list[str]:
    """`opkd train` dotted overrides that turn the GPU config into the workload."""
    teacher = (["teacher.teachers.0.backend=vllm", f"teacher.teachers.0.top_k={w.teacher_top_k}",
                "loss.support=teacher"] if w.teacher_kind == "topk"
               else ["teacher.teachers.0.backend=megatron", "loss.support=null"])
    out = [f"model.student={w.student}", f"teacher.teachers.0.model={w.teacher}", *teacher,
           f"model.params_dtype={w.dtype}", f"rollout.prompts_per_step={w.prompts_per_step}",
           f"rollout.n={w.samples_per_prompt}", f"rollout.max_new_tokens={w.max_new_tokens}",
           f"rollout.temperature={_num(w.temperature)}", f"rollout.top_p={_num(w.top_p)}",
           f"rollout.top_k={w.top_k}",
           f"rollout.seed={w.seed}", f"rollout.max_model_len={w.max_model_len}",
           f"rollout.gpu_memory_utilization={_num(w.gpu_memory_utilization)}",
           f"parallel.micro_batch_size={w.micro_batch_size}",
           f"parallel.max_tokens_per_micro_batch={w.max_tokens_per_micro_batch or 'null'}",
           f"parallel.global_batch_size={w.sequences_per_step}", f"optim.lr={_num(w.lr)}",
           f"optim.clip_grad={_num(w.clip_grad)}", f"data.train_path={prompts_path}", "data.shuffle=false",
           f"run.steps={w.total_steps}", f"run.output_dir={run_dir}",
           "checkpoint.save_at_end=false", "checkpoint.export_hf_at_end=false", "logging.progress_bar=false"]
    if not on_gpu:  # the CPU build of vLLM: no graph capture; float32 everywhere
        out += ["rollout.enforce_eager=true", "teacher.teachers.0.dtype=float32"]
    if w.gpus == 2:  # trainer on one GPU, rollout engine + vLLM teacher on the other
        out += ["controller.kind=ray", "controller.placement=disaggregated", f"run.schedule={w.schedule}",
                f"controller.teachers_with_rollout={'true' if w.teacher_kind == 'topk' else 'false'}"]
    elif w.schedule != "sync":  # one GPU shared by the trainer, the engine generating beside it, the teacher
        out += ["controller.kind=ray", "controller.placement=colocated", f"run.schedule={w.schedule}"]
    return out


def opkd_objective(w: Workload) -> str:
    if w.teacher_kind == "topk":
        return f"top-{w.teacher_top_k} forward KL, both renormalised on the teacher's ids (vLLM teacher)"
    return "exact forward KL over the full vocabulary (dense Megatron teacher in the step)"


def run_opkd(w: Workload, run_dir: str, ctx: dict) -> list[StepRow]:
    """`opkd train` (one process; 2 GPUs: the Ray controller); stages from its metrics.jsonl."""
    overrides = opkd_overrides(w, run_dir, ctx["prompts_path"], ctx["on_gpu"])
    cmd = [sys.executable, "-m", "opkd_mcore.cli", "train", "--config", GPU_CONFIG, *overrides]
    run_logged(cmd, os.path.join(run_dir, "opkd.log"), env=ctx["env"], timeout_s=ctx["timeout_s"],
               what="opkd train")
    steps = [m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "timing/step" in m]
    if len(steps) != w.total_steps:
        raise RunnerFailed(f"opkd train: {run_dir}/metrics.jsonl has {len(steps)} steps, "
                           f"expected {w.total_steps}")
    return [StepRow(runner="opkd", step=i, warmup=i < w.warmup_steps, step_s=m["timing/step"],
                    response_tokens=int(m["rollout/response_tokens"]), objective=opkd_objective(w),
                    generation_s=m["timing/rollout"], teacher_s=m["timing/teacher"],
                    train_s=m["timing/train"],
                    weight_update_s=m["timing/weight_sync"], version=f"opkd-mcore {opkd_mcore.__version__}",
                    notes=f"run.schedule={w.schedule}" if w.gpus == 2 or w.schedule != "sync" else "")
            for i, m in enumerate(steps)]


# ------------------------------------------------------------------------------- plain, trl, verl

def _run_child(name: str, script: str, python: str, w: Workload, run_dir: str, ctx: dict,
               extra_env: dict | None = None, *, partial_ok: bool = False) -> list[StepRow]:
    """A runner that is a script of tools/ run by `python`: it reads workload.json, writes rows.jsonl.
    `partial_ok`: the script may stop at its deadline with fewer steps (its rows' notes say so)."""
    env = {**ctx["env"], **(extra_env or {})}
    rows_path = os.path.join(run_dir, "rows.jsonl")
    cmd = [python, os.path.join(ROOT, "tools", script), ctx["workload_path"], ctx["prompts_path"], rows_path]
    run_logged(cmd, os.path.join(run_dir, f"{name}.log"), env=env, timeout_s=ctx["timeout_s"], what=name)
    rows = read_rows(rows_path)
    if len(rows) != w.total_steps and not (partial_ok and any(not r.warmup for r in rows)):
        raise RunnerFailed(f"{name}: {rows_path} has {len(rows)} steps, expected {w.total_steps}")
    return rows


def run_plain(w: Workload, run_dir: str, ctx: dict) -> list[StepRow]:
    """tools/plain_step.py: the train stage in plain transformers + torch, timed alone."""
    return _run_child("plain", "plain_step.py", sys.executable, w, run_dir, ctx)


def trl_env(ctx: dict) -> dict:
    """TRL's runner's environment: `--trl-path` first on its PYTHONPATH (TRL installed apart)."""
    env = dict(ctx["env"])
    if ctx["trl_path"]:
        env["PYTHONPATH"] = os.pathsep.join([ctx["trl_path"], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_trl(w: Workload, run_dir: str, ctx: dict) -> list[StepRow]:
    """tools/bench_peers_trl.py in TRL's interpreter. 2 GPUs: its vLLM server on the second GPU."""
    env = trl_env(ctx)
    python_can_import(ctx["trl_python"], "trl", env)
    gpus = ctx["gpus"]
    extra = {"CUDA_VISIBLE_DEVICES": gpus[0], "OPKD_PEERS_SECOND_GPU": gpus[1]} if w.gpus == 2 else {}
    return _run_child("trl", "bench_peers_trl.py", ctx["trl_python"], w, run_dir, ctx,
                      {"PYTHONPATH": env["PYTHONPATH"], **extra})


# verl 0.9.1 patches TRL's value-head model whenever `trl` is importable, from `trl.experimental.ppo`
# or `trl`; TRL 1.x has it in neither, and verl's actor then fails to build
VERL_TRL_PROBE = ("import importlib, importlib.util, sys\n"
                  "if importlib.util.find_spec('trl') is None: sys.exit(0)\n"
                  "try:\n"
                  "    importlib.import_module('trl.experimental.ppo').AutoModelForCausalLMWithValueHead\n"
                  "except Exception:\n"
                  "    import trl\n"
                  "    sys.exit(0 if hasattr(trl, 'AutoModelForCausalLMWithValueHead') else 3)")


VERL_DEADLINE_ENV = "OPKD_PEERS_VERL_DEADLINE_S"
VERL_DEADLINE_MARGIN_S = 30.0


def check_verl_sees_no_unusable_trl(python: str, env: dict) -> None:
    out = subprocess.run([python, "-c", VERL_TRL_PROBE], capture_output=True, text=True, timeout=600, env=env)
    if out.returncode == 3:
        raise RunnerFailed(f"verl 0.9.1 imports trl's AutoModelForCausalLMWithValueHead wherever trl is "
                           f"importable, and the trl that {python} imports has none (TRL 1.x): install TRL "
                           f"in a directory of its own and pass it as --trl-path (tools/gpu/README.md)")
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise RunnerFailed(f"verl: probing {python}'s trl failed ({last})")


def run_verl(w: Workload, run_dir: str, ctx: dict) -> list[StepRow]:
    """tools/bench_peers_verl.py in verl's interpreter: verl.trainer.main_ppo with distillation."""
    if w.gpus < 2:
        raise RunnerFailed("verl 0.9.1 places its teacher server in a resource pool of its own "
                           "(distillation.n_gpus_per_node beside trainer.n_gpus_per_node): it needs --gpus 2")
    python_can_import(ctx["verl_python"], "verl", ctx["env"])
    check_verl_sees_no_unusable_trl(ctx["verl_python"], ctx["env"])
    # verl takes minutes to start: its runner stops it short of our timeout and keeps the steps it
    # finished, where our timeout would leave nothing
    deadline = max(ctx["timeout_s"] - VERL_DEADLINE_MARGIN_S, 1.0)
    return _run_child("verl", "bench_peers_verl.py", ctx["verl_python"], w, run_dir, ctx,
                      {VERL_DEADLINE_ENV: f"{deadline:.0f}"}, partial_ok=True)


RUN = {"opkd": run_opkd, "plain": run_plain, "trl": run_trl, "verl": run_verl}


# ------------------------------------------------------------------------------------------- table

def _median_range(values: list[float]) -> dict[str, float]:
    q = percentiles(values)
    return {"p50": q["p50"], "p20": q["p20"], "p80": q["p80"]}


def summarize(runner: str, pair: str, w: Workload, rows: list[StepRow]) -> dict:
    """One table row: medians (p20, p80) of each stage over the measured steps, tokens/s, memory."""
    measured = [r for r in rows if not r.warmup]
    out = {"runner": runner, "pair": pair, "teacher": _teacher_label(w), "gpus": w.gpus,
           "steps": len(measured), "objective": measured[0].objective, "version": measured[0].version,
           "notes": measured[0].notes, "workload": asdict(w)}
    for stage in ("generation_s", "teacher_s", "train_s", "weight_update_s", "step_s"):
        values = [getattr(r, stage) for r in measured if getattr(r, stage) is not None]
        out[stage] = _median_range(values) if values else None
    out["response_tokens"] = statistics.median(r.response_tokens for r in measured)
    calls = [r.generation_calls for r in measured if r.generation_calls is not None]
    out["generation_calls"] = statistics.median(calls) if calls else None
    out["tokens_per_s"] = _median_range([r.response_tokens / r.step_s for r in measured])
    peaks = [r.peak_memory_gib for r in rows if r.peak_memory_gib]
    out["peak_memory_gib"] = [max(col) for col in zip(*peaks)] if peaks else None
    out["memory_source"] = next((r.memory_source for r in rows if r.memory_source), "")
    return out


def _teacher_label(w: Workload) -> str:
    return f"top-{w.teacher_top_k}" if w.teacher_kind == "topk" else "dense"


def add_ratios(summaries: list[dict]) -> None:
    """Against opkd's row of the same pair (None where opkd or the stage did not run): `opkd_ratio` =
    opkd's response tokens/s over this row's (whole steps; the plain row times its train stage only),
    `opkd_train_speedup` = this row's train seconds over opkd's (the plain baseline's comparison). A
    row whose steps generated a different number of response tokens than opkd's keeps opkd's count
    beside its own (`opkd_response_tokens`) and says so in its notes: its tokens/s is not of the same work."""
    opkd = {s["pair"]: s for s in summaries if s["runner"] == "opkd" and s.get("tokens_per_s")}
    for s in summaries:
        ref = opkd.get(s["pair"])
        rate, train = (s.get("tokens_per_s") or {}).get("p50"), (s.get("train_s") or {}).get("p50")
        s["opkd_ratio"] = round(ref["tokens_per_s"]["p50"] / rate, 3) if ref and rate else None
        ref_train = (ref or {}).get("train_s") or {}
        s["opkd_train_speedup"] = (round(train / ref_train["p50"], 3) if train and ref_train.get("p50")
                                   else None)
        tokens = s.get("response_tokens")
        if ref and tokens is not None and tokens != ref["response_tokens"]:
            s["opkd_response_tokens"] = ref["response_tokens"]
            note = (f"{tokens:g} response tokens per step against opkd's {ref['response_tokens']:g}: "
                    "not the same generation work")
            s["notes"] = f"{s['notes']}; {note}" if s.get("notes") else note


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return f"{value['p50']:.3g} ({value['p20']:.3g}-{value['p80']:.3g})"
    if isinstance(value, list):
        return "/".join(f"{x:.1f}" for x in value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


TABLE = (("runner", "runner"), ("pair", "pair"), ("teacher", "teacher"), ("gpus", "GPUs"),
         ("generation_s", "generation s"), ("teacher_s", "teacher s"), ("train_s", "train s"),
         ("weight_update_s", "weight update s"), ("step_s", "step s"), ("response_tokens", "response tokens"),
         ("tokens_per_s", "response tokens/s"), ("peak_memory_gib", "peak GiB per GPU"),
         ("opkd_ratio", "opkd tokens/s ÷ this"), ("opkd_train_speedup", "this train s ÷ opkd's"),
         ("objective", "objective"), ("notes", "notes"))


def table_rows(summaries: list[dict]) -> list[dict]:
    """The summaries as printable cells; a runner that failed shows what stopped it as its objective."""
    out = []
    for s in summaries:
        if "error" in s:
            s = {**{k: s[k] for k in ("runner", "pair", "teacher", "gpus")},
                 "objective": "not run: " + s["error"].splitlines()[0]}
        cells = {title: _cell(s.get(key)) for key, title in TABLE}
        if s.get("opkd_response_tokens") is not None:
            cells["response tokens"] += f" (opkd {_cell(s['opkd_response_tokens'])})"
        out.append(cells)
    return out


# --------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="opkd bench peers", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="the workload (Workload fields, their defaults; --set FIELD=VALUE changes one):\n"
               + Workload.describe())
    p.add_argument("--runners", type=choices_list(RUNNERS), default="opkd,plain,trl,verl",
                   help=f"comma-separated, of {','.join(RUNNERS)}")
    p.add_argument("--pairs", default="0.6b:1.7b,1.7b:4b",
                   help=f"student:teacher shapes ({','.join(PAIR_SHAPES)}), "
                        "checkpoints in --models-dir/qwen3-<shape>")
    p.add_argument("--teacher", default="topk:64", help="topk:K (the teacher's top-K rows) or dense")
    p.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="GPUs per runner (2: disaggregated)")
    p.add_argument("--models-dir", default="/tmp/models", help="where the pairs' checkpoints are")
    p.add_argument("--make-models", action="store_true",
                   help="make missing checkpoints (tools/make_model.py)")
    p.add_argument("--student", default=None, help="student checkpoint directory (instead of --pairs)")
    p.add_argument("--teacher-model", default=None, help="teacher checkpoint directory (with --student)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a workload field")
    p.add_argument("--out", default="/tmp/bench_peers", help="run directories, logs and step rows")
    p.add_argument("--trl-python", default=sys.executable, help="interpreter with trl installed")
    p.add_argument("--verl-python", default=sys.executable, help="interpreter with verl installed")
    p.add_argument("--trl-path", default=None,
                   help="a directory put first on TRL's runner's PYTHONPATH: TRL installed apart, because "
                        "verl 0.9.1 fails where TRL 1.x is importable")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one runner may take")
    bench_common.add_results_argument(p)
    return p.parse_args(argv)


def build_workload(args, on_gpu: bool) -> Workload:
    teacher = {"teacher_kind": "dense"} if args.teacher == "dense" else None
    if teacher is None:
        kind, _, k = args.teacher.partition(":")
        if kind != "topk" or not k.isdigit():
            raise SystemExit(f"--teacher: expected topk:K or dense, got {args.teacher!r}")
        teacher = {"teacher_kind": "topk", "teacher_top_k": int(k)}
    changes = {**teacher, "gpus": args.gpus}
    if not on_gpu:
        changes["dtype"] = "float32"
    types = {f.name: f.type for f in fields(Workload)}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--set {item}: no workload field {name!r} (fields: {', '.join(types)})")
        kind = {"int": int, "float": float,
                "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(types[name], str)
        changes[name] = kind(value)
    workload = replace(Workload(), **changes)
    workload.validate()
    return workload


def pair_workloads(args, base: Workload) -> list[tuple[str, Workload]]:
    if args.student:
        return [("custom", replace(base, student=args.student, teacher=args.teacher_model or base.teacher))]
    out = []
    for pair in args.pairs.split(","):
        student, _, teacher = pair.partition(":")
        if student not in PAIR_SHAPES or teacher not in PAIR_SHAPES:
            raise SystemExit(f"--pairs {pair}: expected STUDENT:TEACHER of {','.join(PAIR_SHAPES)}")
        dirs = [os.path.join(args.models_dir, PAIR_SHAPES[s]) for s in (student, teacher)]
        for shape, path, seed in ((PAIR_SHAPES[student], dirs[0], 1), (PAIR_SHAPES[teacher], dirs[1], 2)):
            if os.path.isdir(path):
                continue
            make = [sys.executable, os.path.join(ROOT, "tools", "make_model.py"), "--shape", shape,
                    "--out", path, "--seed", str(seed),
                    "--device", "cuda" if torch.cuda.is_available() else "cpu"]
            if not args.make_models:
                raise SystemExit(f"{path}: no checkpoint; make it with `{' '.join(make)}` "
                                 "or pass --make-models")
            subprocess.run(make, check=True)
        out.append((pair, replace(base, student=dirs[0], teacher=dirs[1])))
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them; empty on a CPU run."""
    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g for g in env.split(",") if g] if env else [str(i) for i in range(torch.cuda.device_count())]


def make_context(w: Workload, pair_dir: str, physical_gpus: list[str], *, timeout_s: float = 1800.0,
                 trl_python: str = sys.executable, verl_python: str = sys.executable,
                 trl_path: str | None = None) -> dict:
    """What every runner of one pair reads: workload.json and prompts.jsonl written in `pair_dir`, the
    GPUs, the environment and the interpreters of the peers."""
    os.makedirs(pair_dir, exist_ok=True)
    ctx = {"on_gpu": bool(physical_gpus), "gpus": physical_gpus[:w.gpus], "env": child_env(w, physical_gpus),
           "timeout_s": timeout_s, "trl_python": trl_python, "verl_python": verl_python, "trl_path": trl_path,
           "workload_path": os.path.join(pair_dir, "workload.json"),
           "prompts_path": os.path.join(pair_dir, "prompts.jsonl")}
    with open(ctx["workload_path"], "w") as f:
        json.dump(asdict(w), f, indent=1)
    with open(ctx["prompts_path"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in w.prompt_records())
    return ctx


def run_pair(pair: str, w: Workload, runners: list[str], args, physical_gpus: list[str]) -> list[dict]:
    """Every runner on one model pair, one after the other; a failed runner becomes an error row."""
    pair_dir = os.path.join(args.out, pair.replace(":", "_from_") + f"_{_teacher_label(w)}_{w.gpus}gpu")
    ctx = make_context(w, pair_dir, physical_gpus, timeout_s=args.timeout, trl_python=args.trl_python,
                       verl_python=args.verl_python, trl_path=args.trl_path)
    summaries = []
    for name in runners:
        run_dir = os.path.join(pair_dir, name)
        os.makedirs(run_dir, exist_ok=True)
        print(f"[{pair}] {name} ...", flush=True)
        try:
            with GpuMemoryPeak() as memory:
                rows = RUN[name](w, run_dir, ctx)
            peaks = memory.gib(physical_gpus[:w.gpus])
            if peaks:
                for row in rows:
                    row.peak_memory_gib, row.memory_source = peaks, "nvidia-smi used, peak over the run"
            write_rows(os.path.join(run_dir, "steps.jsonl"), rows)
            summaries.append(summarize(name, pair, w, rows))
        except RunnerFailed as err:
            print(f"[{pair}] {name}: {err}\n{err.detail}", file=sys.stderr, flush=True)
            summaries.append({"runner": name, "pair": pair, "teacher": _teacher_label(w), "gpus": w.gpus,
                              "error": str(err), "workload": asdict(w)})
    return summaries


def main(argv=None) -> int:
    args = parse_args(argv)
    runners = args.runners
    physical = visible_gpus()
    if physical and len(physical) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: only {len(physical)} GPU(s) visible ({','.join(physical)})")
    base = build_workload(args, on_gpu=bool(physical))
    summaries = []
    for pair, workload in pair_workloads(args, base):
        summaries += run_pair(pair, workload, runners, args, physical)
    add_ratios(summaries)
    meta = run_metadata(workload=asdict(base), runners=runners)
    record(args.results, meta, summaries, table=False)
    print_table(table_rows(summaries), [title for _, title in TABLE])
    return 1 if any("error" in s for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
