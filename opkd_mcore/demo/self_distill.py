"""`opkd demo --variant self_distill`: the student learns from itself with privileged context, on a CPU.

Nothing is downloaded, and no other model takes part in the distillation.

1. the demo's task (fixed-width addition, answer digits reversed); the privileged context is the
   answer itself, in the teacher's prompt: `"250|07+45="` where the student sees `"07+45="`
   (`data.teacher_prompt_template: "{answer}|{prompt}"`);
2. one small model that copies an answer it is given but computes poorly: trained supervised with
   the Megatron engine to compute (`model_sft/`), its MLPs then cut to a few neurons (as the main
   demo's student: near 0% after the cut, `model_pruned/`), then trained for a few steps to copy the
   answer from the teacher prompt (`student_init/`). With the context it is right nearly always,
   without it rarely: the context is something this model can use;
3. on-policy self-distillation through the real pipeline (`opkd train`): vLLM rollouts of the plain
   prompts, the model scoring each response after the teacher prompt inside the student's step
   (`teacher.teachers.0.backend: self` with `weights: initial`, a frozen copy of the starting model:
   with the current weights this model learns to ignore the context instead, and both collapse), the
   dense forward KL in Megatron, weight sync back into vLLM;
4. held-out greedy exact match *without* the context before and after (and of the starting model
   with it), and the per-token KL from the starting model with the context to the student without
   it, computed with `transformers` from the checkpoints; a table, `summary.json`, `metrics.jsonl`,
   a PNG plot.

`--quick` (CI) uses 1-digit addition and fewer steps.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from opkd_mcore.config import load_config
from opkd_mcore.data import ALPHABET, AdditionTask
from opkd_mcore.demo.common import (
    distill,
    prepare_demo_dir,
    prune_mlp,
    sft_pairs,
    supervised,
    timing_means,
    write_summary,
)
from opkd_mcore.demo.evaluate import hf_greedy_accuracy, hf_heldout_kl, write_eval_file
from opkd_mcore.demo.sft import SftConfig
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

logger = logging.getLogger(__name__)

SEPARATOR = "|"  # between the privileged answer and the prompt in the teacher's prompt
TEACHER_PROMPT_TEMPLATE = "{answer}" + SEPARATOR + "{prompt}"


def config_path() -> str:
    """The variant's distillation config, `self_distill_cpu.yaml` beside this module (package data)."""
    from importlib.resources import files

    return str(files("opkd_mcore.demo").joinpath("self_distill_cpu.yaml"))


def _sft(steps: int, batch: int) -> SftConfig:
    return SftConfig(steps=steps, batch_size=batch, micro_batch_size=batch)


@dataclass(kw_only=True)
class SelfDistillDemo:
    """Sizes of the variant (the distillation settings are in `self_distill_cpu.yaml`)."""

    digits: int = 2  # operand digits of the addition task
    num_train: int = 2000  # training problems (capped by the problems there are)
    num_eval: int = 128  # held-out problems
    model: TinyModelShape = field(default_factory=lambda: TinyModelShape(
        vocab_size=32, hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=64))
    sft: SftConfig = field(default_factory=lambda: _sft(400, 128))  # the compute stage
    sft_lr: float = 3e-3  # peak learning rate of both supervised stages (cosine to a tenth)
    mlp_neurons: int = 64  # every MLP cut to its first neurons after the compute stage
    copy_sft: SftConfig = field(default_factory=lambda: _sft(40, 128))  # then: copy the given answer
    eval_every: int = 10  # distillation steps between greedy evaluations (without the context)
    overrides: list[str] = field(default_factory=list)  # extra dotted overrides of the distillation


def quick_self_distill() -> SelfDistillDemo:
    return SelfDistillDemo(digits=1, num_eval=20, sft=_sft(150, 64), sft_lr=5e-3, mlp_neurons=32,
                           copy_sft=_sft(30, 64), eval_every=5,
                           overrides=["run.steps=40", "rollout.prompts_per_step=16", "data.num_train=80",
                                      "parallel.global_batch_size=32", "parallel.micro_batch_size=32"])


def with_context(records: list[dict]) -> list[dict]:
    """The records with their teacher prompt (`teacher_prompt`) and, for evaluating the model with its
    privileged context, that prompt in place of theirs (`context_prompt`)."""
    out = []
    for r in records:
        teacher_prompt = TEACHER_PROMPT_TEMPLATE.format(**r)
        out.append({**r, "teacher_prompt": teacher_prompt, "context_prompt": teacher_prompt})
    return out


def make_start_model(demo: SelfDistillDemo, out: str, records: list[dict]) -> str:
    """`out/student_init`: trained to compute (`model_sft`), its MLPs cut (`model_pruned`), then
    trained to copy the answer from the teacher prompt. Returns its directory."""
    from transformers import AutoTokenizer

    init, trained, pruned, start = (os.path.join(out, name) for name in
                                    ("model_init", "model_sft", "model_pruned", "student_init"))
    tokenizer = AutoTokenizer.from_pretrained(init)
    supervised(init, trained, sft_pairs(tokenizer, records, "prompt"), demo.sft, demo.sft_lr,
               os.path.join(out, "sft_compute.jsonl"), "supervised: compute")
    prune_mlp(trained, pruned, demo.mlp_neurons)
    supervised(pruned, start, sft_pairs(tokenizer, records, "teacher_prompt"), demo.copy_sft, demo.sft_lr,
               os.path.join(out, "sft_copy.jsonl"), "supervised: copy")
    return start


def accuracy(model_dir: str, records: list[dict], max_new: int, prompt_key: str = "prompt") -> float:
    """Greedy exact match with `transformers`, the prompt read from `prompt_key`."""
    prompts = [{"prompt": r[prompt_key], "answer": r["answer"]} for r in records]
    acc, _ = hf_greedy_accuracy(model_dir, prompts, max_new)
    return acc


def run_self_distill_demo(demo: SelfDistillDemo, out: str, extra_overrides: list[str] | None = None, *,
                          overwrite: bool = False) -> dict:
    """The variant into `out`; `overwrite` replaces an earlier demo's output there."""
    start = time.perf_counter()
    out = os.path.abspath(out)
    paths = {name: os.path.join(out, name) for name in ("model_init", "student_init", "student_hf")}
    task = AdditionTask(demo.digits)
    overrides = [f"model.student={paths['student_init']}", f"run.output_dir={out}",
                 f"data.task_digits={demo.digits}", f"data.num_eval={demo.num_eval}",
                 f"data.num_train={min(demo.num_train, task.num_problems - demo.num_eval)}",
                 f"data.teacher_prompt_template='{TEACHER_PROMPT_TEMPLATE}'", *demo.overrides,
                 *(extra_overrides or [])]  # the user's last: they win
    cfg = load_config(config_path(), overrides, check_files=False)  # a bad override: before any work
    prepare_demo_dir(out, overwrite)
    train_records, held_out = task.splits(cfg.data.num_train, cfg.data.num_eval, seed=cfg.data.seed)
    train_records, held_out = with_context(train_records), with_context(held_out)
    os.makedirs(out, exist_ok=True)
    write_eval_file(os.path.join(out, "eval.jsonl"), held_out, extra=("teacher_prompt",))
    save_tiny_hf_model(paths["model_init"], "qwen3", demo.model, seed=cfg.run.seed,
                       alphabet=ALPHABET + SEPARATOR)
    t_sft = time.perf_counter()
    make_start_model(demo, out, train_records)
    t_sft = time.perf_counter() - t_sft
    cfg = load_config(config_path(), overrides)  # validated now that the model exists
    max_new = task.answer_len + 1
    before = {"student": accuracy(paths["student_init"], held_out, max_new),
              "context": accuracy(paths["student_init"], held_out, max_new, "context_prompt"),
              "kl": hf_heldout_kl(paths["student_init"], paths["student_init"], held_out, "teacher_prompt")}
    t_distill = time.perf_counter()
    history = distill(cfg, held_out, demo.eval_every)
    t_distill = time.perf_counter() - t_distill
    summary = {
        "variant": "self_distill", "teacher": "the student itself with the answer in its prompt",
        "teacher_prompt_template": TEACHER_PROMPT_TEMPLATE,
        "student_accuracy_before": before["student"],
        "student_accuracy_after": accuracy(paths["student_hf"], held_out, max_new),
        "teacher_with_context_accuracy": before["context"],
        "student_with_context_accuracy_after": accuracy(paths["student_hf"], held_out, max_new,
                                                        "context_prompt"),
        "kl_before": before["kl"],
        # the teacher is the frozen starting model (weights: initial): the student after, against it
        "kl_after": hf_heldout_kl(paths["student_init"], paths["student_hf"], held_out, "teacher_prompt"),
        "seconds": time.perf_counter() - start, "seconds_sft": t_sft, "seconds_distill": t_distill,
        "distill_steps": len(history), "task": f"{demo.digits}-digit addition", "num_eval": len(held_out),
        "timing_means": timing_means(history),
    }
    write_summary(out, summary, history, kl_title="KL to the starting model with the context (on-policy)")
    print(results_table(summary))
    print(f"seconds: {summary['seconds']:.0f}  (supervised stages {t_sft:.0f}, "
          f"self-distillation {t_distill:.0f})")
    print(f"wrote {out}/summary.json, metrics.jsonl, distill.png, eval.jsonl, student_init/, student_hf/")
    return summary


def results_table(summary: dict) -> str:
    """The variant's before/after numbers as a small Markdown table."""
    rows = [("teacher: the starting model, answer in its prompt", summary["teacher_with_context_accuracy"],
             None),
            ("student before: the same model, plain prompt", summary["student_accuracy_before"],
             summary["kl_before"]),
            ("student after", summary["student_accuracy_after"], summary["kl_after"])]
    lines = ["| model | exact match | held-out KL(teacher ‖ student) / token |", "| --- | --- | --- |"]
    for name, acc, kl in rows:
        lines.append(f"| {name} | {acc:.3f} | {'' if kl is None else f'{kl:.4f}'} |")
    return "\n".join(lines)
