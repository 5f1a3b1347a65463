"""What every `opkd demo` variant shares: its output directory, the MLP pruning that leaves a trained
model near 0% accuracy, and the timings it reports."""
from __future__ import annotations

import os

from opkd_mcore.config import ConfigError
from opkd_mcore.train.checkpoint import RUN_ARTIFACTS, find_artifacts, remove_artifacts

# What the demos write into --out besides the distillation run's own output (`RUN_ARTIFACTS`): a
# directory holding any of them is refused, and --overwrite removes exactly these and those (of
# either variant: a directory holds one demo's output).
DEMO_ARTIFACTS = ("teacher_init", "teacher_hf", ".teacher_hf.tmp-*", ".teacher_hf.old-*", "student_init",
                  ".student_init.tmp-*", ".student_init.old-*", "model_init", "model_sft", ".model_sft.tmp-*",
                  ".model_sft.old-*", "model_pruned", "eval.jsonl", "teacher_sft.jsonl", "sft_compute.jsonl",
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


def timing_means(history: list[dict]) -> dict:
    """Mean seconds per stage over the steps after the first (which includes warm-up)."""
    rows = history[1:] or history
    keys = sorted(k for k in rows[0] if k.startswith("timing/")) if rows else []
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


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
