"""What every `opkd demo` variant shares: its output directory, the supervised stage that trains a
model on the task, the MLP pruning that leaves a trained model near 0% accuracy, the distillation
with its periodic evaluation, and the summary it writes."""
from __future__ import annotations

import json
import os

from opkd_mcore.config import ConfigError, TrainConfig
from opkd_mcore.config.schema import OptimSection
from opkd_mcore.data import encode_prompt
from opkd_mcore.demo.evaluate import answer_ids, plot_curves, vllm_greedy_accuracy
from opkd_mcore.demo.sft import SftConfig, run_sft
from opkd_mcore.launch import train
from opkd_mcore.models import save_hf_checkpoint
from opkd_mcore.platform.parallel import destroy_parallel
from opkd_mcore.train.checkpoint import RUN_ARTIFACTS, find_artifacts, remove_artifacts
from opkd_mcore.train.components import build_student, init_distributed

# What the demos write into --out besides the distillation run's own output (`RUN_ARTIFACTS`): a
# directory holding any of them is refused, and --overwrite removes exactly these and those (of
# every variant: a directory holds one demo's output). The cross-tokenizer variant's char-level
# model (`char_*`) is the one its student is cut from.
DEMO_ARTIFACTS = ("teacher_init", "teacher_hf", ".teacher_hf.tmp-*", ".teacher_hf.old-*", "student_init",
                  ".student_init.tmp-*", ".student_init.old-*", "model_init", "model_sft", ".model_sft.tmp-*",
                  ".model_sft.old-*", "model_pruned", "char_init", "char_hf", ".char_hf.tmp-*",
                  ".char_hf.old-*", "eval.jsonl", "teacher_sft.jsonl", "char_sft.jsonl", "sft_compute.jsonl",
                  "sft_copy.jsonl", "summary.json", "distill.png")


def prepare_demo_dir(out: str, overwrite: bool) -> None:
    """Refuse an `out` holding an earlier demo's or run's output, or with `overwrite` remove exactly
    that output; before anything is built."""
    patterns = DEMO_ARTIFACTS + RUN_ARTIFACTS
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out: {out} is an existing file; expected a directory")
    found = find_artifacts(out, patterns)
    if found and not overwrite:
        raise ConfigError(f"--out: {out} holds an earlier demo's or run's output ({', '.join(found)}); "
                          "replace it with --overwrite (nothing else in the directory is touched), or "
                          "choose another --out")
    if overwrite:
        remove_artifacts(out, patterns)


def sft_pairs(tokenizer, records: list[dict],
              prompt_key: str = "prompt") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) of each record, the prompt read from `prompt_key`."""
    return [(encode_prompt(tokenizer, r[prompt_key]), answer_ids(tokenizer, r["answer"])) for r in records]


def supervised(src_dir: str, out_dir: str, pairs: list, sft: SftConfig, lr: float, log_path: str,
               desc: str) -> None:
    """Supervised training of `src_dir` on `pairs` with the Megatron engine (cosine from `lr` to a
    tenth), the loss per step in `log_path`, exported to `out_dir` as an HF checkpoint."""
    init_distributed(TrainConfig())
    try:
        optim = OptimSection(lr=lr, warmup_steps=min(50, sft.steps // 4), clip_grad=1.0,
                             lr_decay_style="cosine", lr_decay_steps=sft.steps, min_lr=lr / 10)
        engine, chunks = build_student(src_dir, optim)
        with open(log_path, "w") as f:
            run_sft(engine, pairs, sft, desc=desc, on_step=lambda step, m: f.write(
                json.dumps({"step": step, "sft/loss": m["train/loss"]}) + "\n"))
        engine.fresh_params()
        save_hf_checkpoint(chunks, out_dir, src_hf_dir=src_dir, progress=False)
    finally:
        destroy_parallel()


def prune_mlp(teacher_dir: str, out_dir: str, neurons: int) -> str:
    """An HF checkpoint of the teacher with every MLP cut to its first `neurons` neurons."""
    import copy
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    if not 0 < neurons <= teacher.config.intermediate_size:
        raise ValueError(f"student_mlp: expected 1..{teacher.config.intermediate_size}, got {neurons}")
    config = copy.deepcopy(teacher.config)
    config.intermediate_size = neurons
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for name, value in teacher.state_dict().items():
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            value = value[:neurons]
        elif name.endswith("down_proj.weight"):
            value = value[:, :neurons]
        state[name] = value.contiguous()
    student.load_state_dict(state, strict=True)
    student.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if os.path.exists(os.path.join(teacher_dir, name)):
            shutil.copy2(os.path.join(teacher_dir, name), os.path.join(out_dir, name))
    return out_dir


def distill(cfg, held_out: list[dict], eval_every: int) -> list[dict]:
    """`opkd train` on `cfg`, with greedy held-out accuracy (the records' plain prompts) every
    `eval_every` steps and after the last."""
    answer_len = len(held_out[0]["answer"]) + 1

    def evaluate(run, step):
        last = step + 1 == cfg.run.steps
        if step % eval_every and not last:
            return {}
        return {"eval/accuracy": vllm_greedy_accuracy(run.rollout, run.tokenizer, held_out, answer_len)}

    return train(cfg, step_hook=evaluate)


def timing_means(history: list[dict]) -> dict:
    """Mean seconds per stage over the steps after the first (which includes warm-up)."""
    rows = history[1:] or history
    keys = sorted(k for k in rows[0] if k.startswith("timing/")) if rows else []
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def write_summary(out: str, summary: dict, history: list[dict], **plot) -> None:
    """`summary.json` and the per-step plot `distill.png` (`plot`: `plot_curves`'s titles) in `out`."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_curves(history, os.path.join(out, "distill.png"), **plot)
