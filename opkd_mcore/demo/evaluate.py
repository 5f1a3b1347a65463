"""Evaluation of the demo: greedy exact-match accuracy and held-out teacher->student KL.

The final figures are computed with plain `transformers` from the HF checkpoints the demo writes
(teacher_hf/, student_init/, student_hf/), so anyone can recompute them from the run directory.
During distillation the per-step accuracy comes from the rollout engine (greedy vLLM).
"""
from __future__ import annotations

import json
import os

import torch

from opkd_mcore.data import encode_prompt, exact_match
from opkd_mcore.rollout import SamplingConfig


def _decode(tokenizer, ids: list[int]) -> str:
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[:ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "")


def answer_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]


@torch.no_grad()
def hf_greedy_accuracy(model_dir: str, records: list[dict], max_new_tokens: int) -> tuple[float, list[str]]:
    """Exact-match accuracy of greedy decoding with `transformers` (batched: prompts share a length)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    by_len: dict[int, list[int]] = {}
    prompts = [encode_prompt(tok, r["prompt"]) for r in records]
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    texts = [""] * len(records)
    for idx in by_len.values():
        x = torch.tensor([prompts[i] for i in idx])
        start = x.shape[1]
        for _ in range(max_new_tokens):
            nxt = model(x).logits[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], 1)
        for row, i in zip(x[:, start:].tolist(), idx):
            texts[i] = _decode(tok, row)
    acc = sum(exact_match(t, r["answer"]) for t, r in zip(texts, records)) / len(records)
    return acc, texts


def vllm_greedy_accuracy(rollout, tokenizer, records: list[dict], max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy decoding with the rollout engine (its current weights)."""
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in records]
    samples = rollout.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    return sum(exact_match(_decode(tokenizer, s.response_ids), r["answer"])
               for s, r in zip(samples, records)) / len(records)


@torch.no_grad()
def hf_heldout_kl(teacher_dir: str, student_dir: str, records: list[dict],
                  teacher_prompt_key: str | None = None) -> float:
    """Mean per-token KL(teacher || student) over the answer (+EOS) positions of the held-out
    prompt+answer sequences, full vocabulary, float64. With `teacher_prompt_key` the teacher reads
    each record's answer after that field's prompt (its privileged context), the student after the
    record's own prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64).eval()
    total, count = 0.0, 0
    for r in records:
        answer = answer_ids(tok, r["answer"])
        log_p = _answer_logprobs(teacher, encode_prompt(tok, r[teacher_prompt_key or "prompt"]), answer)
        log_q = _answer_logprobs(student, encode_prompt(tok, r["prompt"]), answer)
        total += float((log_p.exp() * (log_p - log_q)).sum())
        count += log_p.shape[0]
    return total / max(count, 1)


def _answer_logprobs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """`[len(answer), V]` log-probabilities at the positions predicting the answer tokens."""
    seq = torch.tensor([prompt + answer])
    return torch.log_softmax(model(seq).logits[0, len(prompt) - 1:seq.shape[1] - 1], -1)


def write_eval_file(path: str, records: list[dict], extra: tuple[str, ...] = ()) -> None:
    """One `{"prompt", "answer"}` line per held-out record (and the fields `extra` names)."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("prompt", "answer", *extra)}) + "\n")


def results_table(summary: dict) -> str:
    """A small Markdown table of the demo's before/after numbers."""
    rows = [("teacher", summary["teacher_accuracy"], None),
            ("student before", summary["student_accuracy_before"], summary["kl_before"]),
            ("student after", summary["student_accuracy_after"], summary["kl_after"])]
    lines = ["| model | exact match | held-out KL(teacher‖student) / token |", "| --- | --- | --- |"]
    for name, acc, kl in rows:
        lines.append(f"| {name} | {acc:.3f} | {'' if kl is None else f'{kl:.4f}'} |")
    return "\n".join(lines)


def plot_curves(metrics: list[dict], out_png: str,
                kl_title: str = "KL to teacher (on-policy, top-k)") -> str | None:
    """Loss, KL to the teacher and accuracy per step, one panel each; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [("train/loss", "distillation loss"), ("kd/per_token_loss", kl_title),
              ("eval/accuracy", "held-out exact match (greedy)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    for ax, (key, title) in zip(axes, panels):
        pts = [(m["step"], m[key]) for m in metrics if key in m]
        if pts:
            ax.plot(*zip(*pts), marker="." if key.startswith("eval") else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
