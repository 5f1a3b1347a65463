"""`opkd demo [--variant V] [--quick] [--out DIR] [--overwrite]`: on-policy distillation end to end on a CPU.

Nothing is downloaded.

1. a synthetic exact-answer task (fixed-width addition, `data/addition.py`);
2. a teacher trained on it supervised with the Megatron engine, exported to HF (`teacher_hf/`);
3. a smaller student (the teacher with its MLPs pruned to a few neurons, which leaves it near 0%
   accuracy) distilled on-policy through the real pipeline: vLLM rollouts, teacher top-k scores,
   the vocab-parallel loss in Megatron, weight sync back into vLLM (`opkd train`);
4. greedy exact-match accuracy and held-out teacher->student KL before/after, computed with
   `transformers` from the checkpoints; a table, `summary.json`, `metrics.jsonl`, a PNG plot.

`--quick` (CI) uses 1-digit addition, a short teacher SFT and a transformers-forward teacher.
On an accelerator (`--device`, or auto-detected) the teacher runs inside the student's step
(`backend: megatron`) with the same top-k objective from its dense logits: for a model this small a
second vLLM engine's start-up and its per-step scoring call are most of the wall time there.

`--variant` picks one of `VARIANTS`: `distill` (the above, the default), `self_distill` (no teacher
model: the student taught by itself with the answer in its prompt, `demo/self_distill.py`) or
`cross_tokenizer` (the teacher has another tokenizer, `demo/cross_tokenizer.py`). What they share
(output directory, supervised stage, pruning, distillation with evaluation, summary) is
`demo/common.py`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opkd_mcore.config import ConfigError, load_config
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
from opkd_mcore.demo.cross_tokenizer import glued_operator_tokenizer, heldout_kl_across
from opkd_mcore.demo.evaluate import hf_greedy_accuracy, hf_heldout_kl, results_table, write_eval_file
from opkd_mcore.demo.self_distill import SelfDistillDemo, quick_self_distill, run_self_distill_demo
from opkd_mcore.demo.sft import SftConfig
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from opkd_mcore.platform.device import DEVICE_TYPES, is_cpu

logger = logging.getLogger(__name__)


def demo_config_path() -> str:
    """The demo's distillation config, `demo_cpu.yaml` beside this module (package data)."""
    from importlib.resources import files

    return str(files("opkd_mcore.demo").joinpath("demo_cpu.yaml"))


@dataclass(kw_only=True)
class DemoConfig:
    """Sizes of the demo (the distillation settings themselves are in `demo_cpu.yaml` beside this file)."""

    digits: int = 2  # operand digits of the addition task
    num_eval: int = 128  # held-out problems
    teacher: TinyModelShape = field(default_factory=lambda: TinyModelShape(
        vocab_size=32, hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=64))
    # The student is the teacher with its MLPs cut to the first `student_mlp` neurons (pruning then
    # distillation, as in Minitron): ~2.4x fewer parameters, and the cut leaves it near 0% accuracy.
    student_mlp: int = 64
    sft: SftConfig = field(default_factory=lambda: SftConfig(steps=500, batch_size=128, micro_batch_size=128))
    teacher_lr: float = 3e-3  # SFT learning rate of the teacher
    eval_every: int = 10  # distillation steps between greedy evaluations
    in_step_teacher_on_accelerator: bool = True  # off CPU: the teacher in the student's step
    overrides: list[str] = field(default_factory=list)  # extra dotted overrides of the distillation


def quick_demo() -> DemoConfig:
    return DemoConfig(digits=1, num_eval=20, teacher_lr=5e-3, student_mlp=32,
                      in_step_teacher_on_accelerator=False,
                      sft=SftConfig(steps=150, batch_size=64, micro_batch_size=64),
                      eval_every=5, overrides=["run.steps=40", "rollout.prompts_per_step=16",
                                               "parallel.global_batch_size=32",
                                               "parallel.micro_batch_size=32", "data.num_train=80",
                                               "teacher.teachers.0.backend=hf"])


def accelerator_overrides(top_k: int) -> list[str]:
    """The demo's distillation on an accelerator: the teacher scores inside the student's step (one
    engine fewer, no scoring call per step) and the loss keeps the top-`top_k` renormalised objective
    of `demo_cpu.yaml`, now taken from the teacher's dense logits (`loss.k`)."""
    return ["teacher.teachers.0.backend=megatron", "teacher.teachers.0.dtype=auto", f"loss.k={top_k}"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="opkd demo", description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="distill", choices=list(VARIANTS),
                   help=" | ".join(f"{name}: {v.description}" for name, v in VARIANTS.items()))
    p.add_argument("--quick", action="store_true", help="small and short (CI): 1-digit addition")
    p.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier demo's output in --out (only the files a demo writes)")
    p.add_argument("--device", default=None, choices=DEVICE_TYPES,
                   help="where the teacher SFT, the student and the vLLM engines run (default: auto-detect)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the distillation config")
    return p.parse_args(argv)


def make_task(demo: DemoConfig, cfg_data) -> tuple[AdditionTask, list[dict], list[dict]]:
    task = AdditionTask(demo.digits)
    num_train = min(cfg_data.num_train, task.num_problems - demo.num_eval) if demo.digits > 1 else \
        task.num_problems - demo.num_eval
    train, held_out = task.splits(num_train, demo.num_eval, seed=cfg_data.seed)
    return task, train, held_out


def train_teacher(demo: DemoConfig, init_dir: str, out_dir: str, train: list[dict], log_path: str) -> None:
    """Supervised teacher with the Megatron engine, exported to `out_dir` as an HF checkpoint."""
    from transformers import AutoTokenizer

    pairs = sft_pairs(AutoTokenizer.from_pretrained(init_dir), train)
    supervised(init_dir, out_dir, pairs, demo.sft, demo.teacher_lr, log_path, "teacher SFT")


def run_demo(demo: DemoConfig, out: str, extra_overrides: list[str] | None = None, *,
             overwrite: bool = False) -> dict:
    """The demo into `out`; `overwrite` replaces an earlier demo's output there."""
    start = time.perf_counter()
    out = os.path.abspath(out)
    paths = {name: os.path.join(out, name) for name in ("teacher_init", "teacher_hf", "student_init",
                                                        "student_hf")}
    overrides = [f"model.student={paths['student_init']}", f"teacher.teachers.0.model={paths['teacher_hf']}",
                 f"run.output_dir={out}", f"data.task_digits={demo.digits}",
                 f"data.num_eval={demo.num_eval}", *demo.overrides]
    user = list(extra_overrides or [])  # always last: they win
    cfg = load_config(demo_config_path(), overrides + user, validate=False)
    if demo.in_step_teacher_on_accelerator and not is_cpu(cfg.run.device):
        accel = accelerator_overrides(cfg.teacher.teachers[0].top_k)
        logger.info("demo: accelerator run, teacher inside the student's step (%s)", " ".join(accel))
        overrides += accel
    overrides += user
    cfg = load_config(demo_config_path(), overrides, check_files=False)  # a bad override: before any work
    prepare_demo_dir(out, overwrite)
    _, train_records, held_out = make_task(demo, cfg.data)
    os.makedirs(out, exist_ok=True)
    write_eval_file(os.path.join(out, "eval.jsonl"), held_out)
    save_tiny_hf_model(paths["teacher_init"], "qwen3", demo.teacher, seed=cfg.run.seed, alphabet=ALPHABET)
    t_sft = time.perf_counter()
    train_teacher(demo, paths["teacher_init"], paths["teacher_hf"], train_records,
                  os.path.join(out, "teacher_sft.jsonl"))
    t_sft = time.perf_counter() - t_sft
    prune_mlp(paths["teacher_hf"], paths["student_init"], demo.student_mlp)
    cfg = load_config(demo_config_path(), overrides)  # validated now that the teacher checkpoint exists
    return _evaluate_and_distill(cfg, demo, paths, held_out, out, start, t_sft)


def cross_tokenizer_demo(quick: bool) -> DemoConfig:
    """The main demo's sizes (`--quick`: its quick ones) with `loss.cross_tokenizer: gold`; the teacher
    stays a scoring teacher on an accelerator too."""
    demo = quick_demo() if quick else DemoConfig()
    demo.in_step_teacher_on_accelerator = False
    demo.overrides = [*demo.overrides, "loss.cross_tokenizer=gold"]
    return demo


def run_cross_tokenizer_demo(demo: DemoConfig, out: str, extra_overrides: list[str] | None = None, *,
                             overwrite: bool = False, glued: str = "+=") -> dict:
    """The cross-tokenizer variant into `out` (`demo/cross_tokenizer.py`): a char-level model trained
    and cut into the student, a teacher trained with its own tokenizer (`glued`: the operators it
    glues to the next digit), the distillation across them."""
    start = time.perf_counter()
    out = os.path.abspath(out)
    paths = {name: os.path.join(out, name) for name in ("teacher_init", "teacher_hf", "char_init", "char_hf",
                                                        "student_init", "student_hf")}
    overrides = [f"model.student={paths['student_init']}", f"teacher.teachers.0.model={paths['teacher_hf']}",
                 f"run.output_dir={out}", f"data.task_digits={demo.digits}", f"data.num_eval={demo.num_eval}",
                 *demo.overrides, *(extra_overrides or [])]
    cfg = load_config(demo_config_path(), overrides, check_files=False)  # a bad override: before any work
    prepare_demo_dir(out, overwrite)
    _, train_records, held_out = make_task(demo, cfg.data)
    os.makedirs(out, exist_ok=True)
    write_eval_file(os.path.join(out, "eval.jsonl"), held_out)
    t_sft = time.perf_counter()
    save_tiny_hf_model(paths["char_init"], "qwen3", demo.teacher, seed=cfg.run.seed, alphabet=ALPHABET)
    train_teacher(demo, paths["char_init"], paths["char_hf"], train_records,
                  os.path.join(out, "char_sft.jsonl"))
    prune_mlp(paths["char_hf"], paths["student_init"], demo.student_mlp)
    save_tiny_hf_model(paths["teacher_init"], "qwen3", demo.teacher, seed=cfg.run.seed + 1,
                       tokenizer=glued_operator_tokenizer(glued))
    train_teacher(demo, paths["teacher_init"], paths["teacher_hf"], train_records,
                  os.path.join(out, "teacher_sft.jsonl"))
    t_sft = time.perf_counter() - t_sft
    cfg = load_config(demo_config_path(), overrides)  # validated now that both checkpoints exist
    variant = {"variant": "cross_tokenizer", "cross_tokenizer": cfg.loss.cross_tokenizer}
    return _evaluate_and_distill(cfg, demo, paths, held_out, out, start, t_sft, kl=heldout_kl_across,
                                 extra=variant)


def _evaluate_and_distill(cfg, demo: DemoConfig, paths: dict, held_out: list[dict], out: str, start: float,
                          t_sft: float, *, kl=hf_heldout_kl, extra: dict | None = None) -> dict:
    """Accuracy and KL before, the distillation, accuracy and KL after; `summary.json`, the plot."""
    max_new = len(held_out[0]["answer"]) + 1
    teacher_acc, _ = hf_greedy_accuracy(paths["teacher_hf"], held_out, max_new)
    before_acc, _ = hf_greedy_accuracy(paths["student_init"], held_out, max_new)
    kl_before = kl(paths["teacher_hf"], paths["student_init"], held_out)
    t_distill = time.perf_counter()
    history = distill(cfg, held_out, demo.eval_every)
    t_distill = time.perf_counter() - t_distill
    after_acc, _ = hf_greedy_accuracy(paths["student_hf"], held_out, max_new)
    kl_after = kl(paths["teacher_hf"], paths["student_hf"], held_out)
    summary = {
        "teacher_accuracy": teacher_acc, "student_accuracy_before": before_acc,
        "student_accuracy_after": after_acc, "kl_before": kl_before, "kl_after": kl_after,
        "seconds": time.perf_counter() - start, "seconds_teacher_sft": t_sft, "seconds_distill": t_distill,
        "distill_steps": len(history), "task": f"{demo.digits}-digit addition",
        "num_eval": len(held_out), "timing_means": timing_means(history), **(extra or {}),
    }
    write_summary(out, summary, history)
    print(results_table(summary))
    print(f"seconds: {summary['seconds']:.0f}  (teacher SFT {t_sft:.0f}, distillation {t_distill:.0f})")
    print(f"wrote {out}/summary.json, metrics.jsonl, distill.png, eval.jsonl, teacher_hf/, student_hf/")
    return summary


@dataclass(frozen=True)
class Variant:
    """One `--variant` of the demo: what it shows, and how it runs (quick, out, overrides, overwrite)."""

    description: str
    run: Callable[[bool, str, list[str], bool], dict]


def _distill_demo(quick: bool, out: str, overrides: list[str], overwrite: bool) -> dict:
    return run_demo(quick_demo() if quick else DemoConfig(), out, overrides, overwrite=overwrite)


def _self_distill_demo(quick: bool, out: str, overrides: list[str], overwrite: bool) -> dict:
    demo = quick_self_distill() if quick else SelfDistillDemo()
    return run_self_distill_demo(demo, out, overrides, overwrite=overwrite)


def _cross_tokenizer_demo(quick: bool, out: str, overrides: list[str], overwrite: bool) -> dict:
    # --quick: 80 one-digit problems are too few for a teacher to learn ten "+d" tokens (it
    # memorises them, 0% held-out); "=" alone is glued, which no prompt has before a digit
    return run_cross_tokenizer_demo(cross_tokenizer_demo(quick), out, overrides, overwrite=overwrite,
                                    glued="=" if quick else "+=")


VARIANTS = {
    "distill": Variant("a small student from a trained teacher (default)", _distill_demo),
    "self_distill": Variant("one model learns from itself with the answer in its prompt (privileged "
                            "context, teacher backend self)", _self_distill_demo),
    "cross_tokenizer": Variant("the teacher has another tokenizer (loss.cross_tokenizer: gold)",
                               _cross_tokenizer_demo),
}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    if args.device:
        os.environ["OPKD_DEVICE"] = args.device  # the supervised stage and every engine follow it
        overrides.insert(0, f"run.device={args.device}")
    try:
        VARIANTS[args.variant].run(args.quick, args.out, overrides, args.overwrite)
    except ConfigError as err:  # the message names the option or key; a traceback adds nothing
        print(f"opkd demo: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
