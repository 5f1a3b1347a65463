"""A plain `transformers` training step doing the work of `opkd train`'s train stage: the floor.

The student (AutoModelForCausalLM, SDPA attention; bf16 weights on GPU, float32 on CPU) trains on the
step's sequences right-padded into micro-batches of `micro_batch_size` sequences. A dense teacher
runs its forward inside the step (as the Megatron teacher does in `opkd train`); a top-k teacher's
rows (ids and log-probs of its K most likely tokens) are computed once from its forward before the
step and fed as given (as a vLLM teacher's rows arrive). The objective is the one `opkd train` uses
for that teacher, in plain torch (log_softmax, gather, KL; no project kernels): forward KL over the
full vocabulary (dense), or over the teacher's top-k ids with both distributions renormalised on
them (top-k); token mean over the step's response tokens; gradients clipped to `clip_grad`;
`torch.optim.AdamW(fused=True)` on GPU (pure bf16: weights, gradients and Adam states in the model's
dtype, no float32 master copy: the cheapest step, hence a floor). Responses are random token ids of
exactly `max_new_tokens` after each prompt: the train stage's cost depends on shapes, not on which
tokens were sampled.

    python tools/plain_step.py WORKLOAD.json PROMPTS.jsonl ROWS.jsonl   (`opkd bench peers --runners plain`)

`PlainStep` is importable: a benchmark that needs the plain baseline on other shapes builds it here.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_peers, beside this file

from bench_peers import StepRow, Workload, write_rows  # noqa: E402

from opkd_mcore.data import encode_prompt, read_records  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class MicroBatch:
    """Right-padded sequences: `input_ids`, `attention_mask` [B, L]; `loss_mask` [B, L] marks the
    logits positions that predict a response token (position t predicts token t+1)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    topk_ids: torch.Tensor | None = None  # [N, K] at the loss positions, top-k teacher only
    topk_logprobs: torch.Tensor | None = None  # [N, K]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def step_sequences(prompt_ids: list[list[int]], samples: int, response_len: int, vocab_size: int,
                   seed: int) -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) per sample: `samples` per prompt, each response
    `response_len` random ids above the tokenizer's special ids 0..2."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for ids in prompt_ids:
        for _ in range(samples):
            response = torch.randint(3, vocab_size, (response_len,), generator=g).tolist()
            out.append((list(ids) + response, len(ids)))
    return out


def pad_micro_batches(sequences: list[tuple[list[int], int]], micro_batch_size: int,
                      pad_id: int) -> list[MicroBatch]:
    """The sequences in order, `micro_batch_size` per micro-batch, right-padded to its longest."""
    batches = []
    for start in range(0, len(sequences), micro_batch_size):
        chunk = sequences[start:start + micro_batch_size]
        length = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), length), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), length), dtype=torch.bool)
        for row, (ids, prompt_len) in enumerate(chunk):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, :len(ids)] = 1
            loss_mask[row, prompt_len - 1:len(ids) - 1] = True
        batches.append(MicroBatch(input_ids, attention, loss_mask))
    return batches


def forward_kl_sum(student_logits: torch.Tensor, *, teacher_logits: torch.Tensor | None = None,
                   topk_ids: torch.Tensor | None = None,
                   topk_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over rows of KL(p || q), float32. Dense: p = softmax(teacher_logits) over the vocabulary.
    Top-k: p and q both renormalised on the teacher's ids (`topk_logprobs` as given)."""
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    if teacher_logits is not None:
        log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    else:
        log_q = log_q.gather(-1, topk_ids)
        log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
        log_p = topk_logprobs.float() - torch.logsumexp(topk_logprobs.float(), dim=-1, keepdim=True)
    return (log_p.exp() * (log_p - log_q)).sum()


class PlainStep:
    """Student + teacher as plain transformers models and one optimizer step over micro-batches."""

    def __init__(self, student_dir: str, teacher_dir: str, *, teacher_kind: str, top_k: int,
                 dtype: torch.dtype, device: torch.device, lr: float, clip_grad: float):
        kwargs = dict(dtype=dtype, attn_implementation="sdpa")
        self.device, self.teacher_kind, self.top_k, self.clip_grad = device, teacher_kind, top_k, clip_grad
        self.student = AutoModelForCausalLM.from_pretrained(student_dir, **kwargs).to(device).train()
        self.teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, **kwargs).to(device).eval()
        self.teacher.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=lr, weight_decay=0.0,
                                           fused=device.type == "cuda")
        self.teacher_s = 0.0  # seconds of in-step teacher forwards in the last step (dense)

    def _teacher_logits(self, batch: MicroBatch) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits

    def attach_topk(self, batches: list[MicroBatch]) -> None:
        """A top-k teacher's rows at the loss positions, from its forward (outside the timed step)."""
        for batch in batches:
            logits = self._teacher_logits(batch)[batch.loss_mask]
            logprobs, ids = torch.log_softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
            batch.topk_ids, batch.topk_logprobs = ids, logprobs

    def to_device(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        return [MicroBatch(*(t.to(self.device) if t is not None else None for t in
                             (b.input_ids, b.attention_mask, b.loss_mask, b.topk_ids, b.topk_logprobs)))
                for b in batches]

    def step(self, batches: list[MicroBatch], synchronize) -> float:
        """One optimizer step over the micro-batches; the token-mean loss of the step."""
        num_tokens = sum(b.num_loss_tokens for b in batches)
        self.optimizer.zero_grad(set_to_none=True)
        self.teacher_s, total = 0.0, 0.0
        for batch in batches:
            teacher = {}
            if self.teacher_kind == "dense":
                synchronize()
                start = time.perf_counter()
                teacher["teacher_logits"] = self._teacher_logits(batch)[batch.loss_mask]
                synchronize()
                self.teacher_s += time.perf_counter() - start
            else:
                teacher = {"topk_ids": batch.topk_ids, "topk_logprobs": batch.topk_logprobs}
            logits = self.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            loss = forward_kl_sum(logits[batch.loss_mask], **teacher) / num_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.clip_grad)
        self.optimizer.step()
        return total


def _peak_memory(device: torch.device) -> tuple[list[float], str]:
    if device.type == "cuda":
        return [round(torch.cuda.max_memory_allocated() / 2**30, 2)], "torch max allocated"
    return [round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)], "host peak RSS"


def objective(w: Workload) -> str:
    if w.teacher_kind == "dense":
        return "exact forward KL over the full vocabulary (dense teacher forward in the step), plain torch"
    return f"top-{w.teacher_top_k} forward KL, both renormalised on the teacher's ids, plain torch"


def main(argv=None) -> int:
    workload_path, prompts_path, rows_path = (argv or sys.argv[1:])[:3]
    w = Workload.from_json(workload_path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokenizer = AutoTokenizer.from_pretrained(w.student)
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in read_records(prompts_path)]
    plain = PlainStep(w.student, w.teacher, teacher_kind=w.teacher_kind, top_k=w.teacher_top_k,
                      dtype=DTYPES[w.dtype], device=device, lr=w.lr, clip_grad=w.clip_grad)
    vocab = plain.student.config.vocab_size
    rows = []
    for step in range(w.total_steps):
        step_prompts = prompts[step * w.prompts_per_step:(step + 1) * w.prompts_per_step]
        sequences = step_sequences(step_prompts, w.samples_per_prompt, w.max_new_tokens, vocab, w.seed + step)
        batches = plain.to_device(pad_micro_batches(sequences, w.micro_batch_size, tokenizer.pad_token_id))
        if w.teacher_kind == "topk":
            plain.attach_topk(batches)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        plain.step(batches, sync)
        sync()
        seconds = time.perf_counter() - start
        peak, source = _peak_memory(device)
        rows.append(StepRow(
            runner="plain", step=step, warmup=step < w.warmup_steps, step_s=seconds, train_s=seconds,
            teacher_s=plain.teacher_s if w.teacher_kind == "dense" else None,
            response_tokens=sum(b.num_loss_tokens for b in batches), objective=objective(w),
            peak_memory_gib=peak, memory_source=source, version=f"transformers {transformers.__version__}",
            notes="train stage only (no generation, no weight update); "
                  "a dense teacher's forward is inside train"))
    write_rows(rows_path, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
