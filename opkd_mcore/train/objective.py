"""The student's loss on one packed micro-batch, as the engine's `loss_fn(logits_local, batch)`.

Only positions with `loss_mask == 1` (those predicting a response token) are scored. The scalar is
normalised by the *global* count of the step (tokens or sequences, per `loss.aggregation`), so
micro-batch size, gradient accumulation and DP do not change the loss scale. Metrics are returned
as sums already divided by that same global count, so the engine can add them over micro-batches
and DP ranks and get step means.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from opkd_mcore.config.schema import LossSection
from opkd_mcore.losses import (
    DenseTeacher, TopKTeacher, aggregate, kd_loss_with_stats, policy_gradient_kd_loss,
)
from opkd_mcore.train.batch import PackedBatch


@dataclass
class StepCounts:
    """Global denominators of one optimizer step (same on every rank)."""

    num_tokens: int  # response tokens over all micro-batches and DP ranks
    num_seqs: int  # sequences over all micro-batches and DP ranks


def _rows(teacher, idx: torch.Tensor):
    if isinstance(teacher, DenseTeacher):
        return DenseTeacher(logits=teacher.logits[idx])
    return TopKTeacher(ids=teacher.ids[idx], logprobs=teacher.logprobs[idx])


def _token_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """log q(target) from vocab-parallel logits (Megatron's vocab-parallel cross entropy, negated)."""
    from megatron.core import tensor_parallel

    # Megatron's CE takes [S, B, V]; it is differentiable w.r.t. the logits
    return -tensor_parallel.vocab_parallel_cross_entropy(logits_NV.unsqueeze(1).float(),
                                                         targets_N.unsqueeze(1)).squeeze(1)


def _teacher_token_logprobs(teacher: TopKTeacher, targets_N: torch.Tensor) -> torch.Tensor:
    """Teacher logprob of the sampled token; a token outside the teacher's top-k gets its k-th value
    minus log 2 (a bound: it is less likely than anything listed)."""
    hit = teacher.ids == targets_N[:, None]
    listed = torch.where(hit, teacher.logprobs, torch.zeros_like(teacher.logprobs)).sum(1)
    floor = torch.where(teacher.ids >= 0, teacher.logprobs, torch.full_like(teacher.logprobs, 0.0)).amin(1)
    return torch.where(hit.any(1), listed, floor - torch.log(torch.tensor(2.0)))


def make_loss_fn(loss: LossSection, counts: StepCounts, tp_group=None):
    """`loss_fn(logits_local [T, V_local], batch) -> (scalar, metrics)` for the engine."""

    def loss_fn(logits_local: torch.Tensor, batch: PackedBatch):
        idx = batch.loss_mask.nonzero().squeeze(1)
        logits = logits_local[idx]
        seq_ids = batch.seq_ids[idx]
        if loss.form == "policy_gradient":
            per_token, metrics = _policy_gradient(logits, batch, idx, loss)
        else:
            per_token, metrics = _distribution_kd(logits, batch, idx, loss, tp_group)
        mask = torch.ones_like(per_token)
        weights = batch.sequence_weights
        scalar = aggregate(per_token, mask, seq_ids, loss.aggregation, counts.num_tokens,
                           global_num_seqs=counts.num_seqs, seq_weights=weights,
                           num_seqs=batch.num_sequences)
        denom = float(counts.num_tokens)
        out = {name: value.detach().sum() / denom for name, value in metrics.items()}
        out["kd/per_token_loss"] = per_token.detach().sum() / denom
        out["train/response_tokens"] = torch.tensor(float(idx.numel()))
        return scalar, out

    return loss_fn


def _distribution_kd(logits, batch, idx, loss: LossSection, tp_group):
    teacher = _rows(batch.teacher, idx)
    per_token, stats = kd_loss_with_stats(
        logits, teacher, divergence=loss.divergence, beta=loss.beta, temperature=loss.temperature,
        support=loss.support, k=loss.k, mass=loss.mass, coverage_coef=loss.coverage_coef,
        tp_group=tp_group, impl="reference" if loss.impl == "auto" else loss.impl)
    metrics = {"kd/teacher_mass_on_support": stats.teacher_mass.float(),
               "kd/student_mass_on_support": stats.student_mass.float()}
    if stats.topk_overlap is not None:
        metrics["kd/topk_overlap"] = stats.topk_overlap.float()
    return per_token, metrics


def _policy_gradient(logits, batch, idx, loss: LossSection):
    targets = batch.tokens[idx + 1]
    student_lp = _token_logprobs(logits, targets)
    if isinstance(batch.teacher, DenseTeacher):
        teacher_lp = _token_logprobs(batch.teacher.logits[idx].float(), targets).detach()
    else:
        teacher_lp = _teacher_token_logprobs(_rows(batch.teacher, idx), targets)
    task_adv = None
    if loss.task_reward_coef and "task_advantage" in batch.meta:
        task_adv = loss.task_reward_coef * batch.meta["task_advantage"][idx]
    out = policy_gradient_kd_loss(student_lp, batch.sampler_logprobs[idx], teacher_lp,
                                  estimator=loss.kl_estimator, kl_coef=loss.pg_coef,
                                  clip_ratio=loss.clip_eps, task_advantages=task_adv)
    metrics = {"pg/sampled_kl": (student_lp - teacher_lp).detach(),
               "pg/clip_fraction": out.clipped.float()}
    return out.loss, metrics
