"""Supervised fine-tuning with the same Megatron engine (the demo trains its teacher this way).

Cross entropy on the answer tokens of prompt+answer sequences, vocab-parallel (Megatron's
`vocab_parallel_cross_entropy`), normalised by the global number of answer tokens of the step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from opkd_mcore.engine.packing import PackedBatch, pack_sequences


@dataclass(kw_only=True)
class SftConfig:
    """Supervised training of a small model on (prompt ids, answer ids) pairs."""

    steps: int = 500  # optimizer steps
    batch_size: int = 128  # sequences per step
    micro_batch_size: int = 128  # sequences per packed micro-batch
    seed: int = 0  # example order


def ce_loss_fn(num_global_tokens: int):
    """Engine loss: summed vocab-parallel cross entropy of answer tokens / global token count."""
    from megatron.core import tensor_parallel

    def loss_fn(logits: torch.Tensor, batch: PackedBatch):
        idx = batch.loss_mask.nonzero().squeeze(1)
        targets = batch.tokens[idx + 1]
        per_token = tensor_parallel.vocab_parallel_cross_entropy(
            logits[idx].float().unsqueeze(1), targets.unsqueeze(1)).squeeze(1)
        return per_token.sum() / num_global_tokens, {"sft/tokens": torch.tensor(float(idx.numel()))}

    return loss_fn


def sft_batches(pairs: list[tuple[list[int], list[int]]], cfg: SftConfig, step: int) -> list[PackedBatch]:
    """Micro-batches of step `step` (a seeded sample of `batch_size` pairs)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    chosen = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_size)]
    out = []
    for start in range(0, len(chosen), cfg.micro_batch_size):
        part = chosen[start:start + cfg.micro_batch_size]
        out.append(pack_sequences([p + a for p, a in part], [len(p) for p, _ in part]))
    return out


def run_sft(engine, pairs: list[tuple[list[int], list[int]]], cfg: SftConfig, *, progress: bool = True,
            on_step=None, desc: str = "teacher SFT") -> list[dict]:
    """Train `engine` on `pairs`; returns per-step metrics. `on_step(step, metrics)` is called each step."""
    from tqdm import tqdm

    if not pairs:
        raise ValueError("pairs: expected at least one (prompt ids, answer ids) pair")
    history = []
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress)
    for step in bar:
        batches = sft_batches(pairs, cfg, step)
        tokens = sum(b.num_loss_tokens for b in batches)
        metrics = engine.train_step(batches, ce_loss_fn(tokens))
        history.append(metrics)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", refresh=False)
        if on_step is not None:
            on_step(step, metrics)
    return history
