"""The student's loss on one packed micro-batch, as the engine's `loss_fn(logits_local, batch)`.

Only positions with `loss_mask == 1` (those predicting a response token) are scored. The scalar is
normalised by the *global* count of the step (tokens or sequences, per `loss.aggregation`), so
micro-batch size, gradient accumulation and DP do not change the loss scale. Metrics are returned
as sums already divided by that same global count, so the engine can add them over micro-batches
and DP ranks and get step means. Which kernels and which LM-head engine run is the run's loss plan
(`losses/plan.py`), decided once at start-up; this module only follows it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from opkd_mcore.config.loss_rules import cross_tokenizer_mode
from opkd_mcore.config.schema import LossSection
from opkd_mcore.engine.lm_head import LmHeadInput
from opkd_mcore.engine.packing import PackedBatch
from opkd_mcore.losses import (
    CrossTokenizerTeacher,
    DenseTeacher,
    HiddenTeacher,
    TopKTeacher,
    aggregate,
    aggregate_row_weights,
    cross_tokenizer_loss,
    kd_loss_with_stats,
    linear_kd_loss_weighted,
    linear_kd_loss_with_stats,
    policy_gradient_kd_loss,
)
from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.fused_linear import hidden_teacher_logits
from opkd_mcore.losses.plan import LossPlan
from opkd_mcore.losses.teacher_outputs import INVALID_ROWS
from opkd_mcore.losses.validation import invalid_topk_rows


@dataclass
class StepCounts:
    """Global denominators of one optimizer step (same on every rank)."""

    num_tokens: int  # response tokens over all micro-batches and DP ranks
    num_seqs: int  # sequences over all micro-batches and DP ranks


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


def make_loss_fn(plan: LossPlan, counts: StepCounts, tp_group=None):
    """`loss_fn(logits_local [T, V_local] | LmHeadInput, batch) -> (scalar, metrics)` for the engine,
    running the loss path `plan` decided (`losses/plan.py`); the engine hands over an `LmHeadInput`
    (hidden states + output-weight shard) exactly when `plan.fused_lm_head`.

    The loss runs on all T rows of the micro-batch and `loss_mask` selects the response rows:
    gathering those rows first would copy the logits (and their gradient) once more.
    """
    loss = plan.loss

    def loss_fn(logits_local: torch.Tensor | LmHeadInput, batch: PackedBatch):
        mask = batch.loss_mask
        agg = {"mode": loss.aggregation, "global_num_tokens": counts.num_tokens,
               "global_num_seqs": counts.num_seqs, "seq_weights": batch.sequence_weights,
               "num_seqs": batch.num_sequences}
        scalar = None
        if isinstance(logits_local, LmHeadInput):  # the fused LM head: hidden states + weight shard
            if not plan.fused_lm_head:
                raise ValueError(f"logits_local: got an LmHeadInput, but the loss plan has the fused LM head "
                                 f"off ({plan.lm_head_reason}); the engine must get fused_lm_head=False")
            row_weights = None
            if plan.lm_head_engine == "rows":   # the scalar's weights, before the loss
                row_weights = aggregate_row_weights(mask, batch.seq_ids, **agg)
            per_token, metrics, scalar = _fused_head_kd(logits_local, batch, plan, tp_group, row_weights)
        elif isinstance(batch.teacher, HiddenTeacher):  # fused head off: the teacher's logits, formed here
            batch = copy.copy(batch)
            logits = hidden_teacher_logits(batch.teacher, tp_group, dtype=logits_local.dtype)
            batch.teacher = DenseTeacher(logits)
            return loss_fn(logits_local, batch)
        elif isinstance(batch.teacher, CrossTokenizerTeacher):  # a teacher with another tokenizer
            per_token, metrics = _cross_tokenizer_kd(logits_local, batch, plan, tp_group)
        elif loss.form == "policy_gradient":
            per_token, metrics = _policy_gradient(logits_local, batch, loss)
        else:
            per_token, metrics = _distribution_kd(logits_local, batch, plan, tp_group)
        if scalar is None:
            scalar = aggregate(per_token, mask, batch.seq_ids, **agg)
        denom = float(counts.num_tokens)
        counted = mask.bool()
        out = {name: torch.where(counted, value.detach().float(), 0.0).sum() / denom
               for name, value in metrics.items()}
        out["kd/per_token_loss"] = torch.where(counted, per_token.detach(), 0.0).sum() / denom
        out["train/response_tokens"] = mask.sum()
        return scalar, out

    return loss_fn


def _fused_head_kd(head: LmHeadInput, batch, plan: LossPlan, tp_group, row_weights=None):
    """`kd_loss` of the logits `head.hidden @ head.weight.T`, never formed whole: (per-token
    loss, metrics, scalar). With `row_weights` (the rows engine) the scalar is `sum(row_weights *
    loss)`, back-propagated as is; without, None (the caller aggregates the per-token loss)."""
    teacher = batch.teacher
    if isinstance(teacher, HiddenTeacher) and teacher.hidden.dtype != head.hidden.dtype:
        # served rows arrive in bf16; the kernels take one operand dtype (the student's)
        teacher = HiddenTeacher(teacher.hidden.to(head.hidden.dtype), teacher.weight.to(head.hidden.dtype),
                                teacher.vocab_size)
    # validate=False: the rows' contents are checked by `_topk_checks` without a host sync (the row
    # weights are finite by construction: the sequence weights are checked on the host)
    kd = {**plan.kd_kwargs(), "tp_group": tp_group, "impl": plan.lm_head_kernels,
          "validate": False, "vocab_end": head.vocab_size}
    scalar = None
    if row_weights is not None:
        scalar, per_token, stats = linear_kd_loss_weighted(head.hidden, head.weight, teacher, row_weights,
                                                           chunk_bytes=plan.lm_head_chunk_bytes, **kd)
    else:
        per_token, stats = linear_kd_loss_with_stats(head.hidden, head.weight, teacher,
                                                     engine=plan.linear_engine, **kd)
    metrics = {"kd/teacher_mass_on_support": stats.teacher_mass,
               "kd/student_mass_on_support": stats.student_mass,
               **_topk_checks(teacher, head.weight.shape[0], tp_group)}
    if isinstance(teacher, HiddenTeacher):  # dense teacher: agreement and NaN rows from the stats pass
        metrics["teacher/top1_agreement"] = (stats.teacher_top1 == _next_tokens(batch)).float()
        metrics["teacher/nonfinite_rows"] = torch.isnan(stats.lse[:, 1]).float()
    return per_token, metrics, scalar


def _distribution_kd(logits, batch, plan: LossPlan, tp_group):
    per_token, stats = kd_loss_with_stats(
        logits, batch.teacher, **plan.kd_kwargs(), tp_group=tp_group, impl=plan.kd_impl,
        # top-k rows: `_topk_checks` without a host sync; dense rows were checked where they were made
        # (a NaN scan of [N, V] logits would cost a full-size mask)
        validate=False)
    metrics = {"kd/teacher_mass_on_support": stats.teacher_mass,
               "kd/student_mass_on_support": stats.student_mass,
               **_topk_checks(batch.teacher, logits.shape[1], tp_group)}
    if stats.topk_overlap is not None:
        metrics["kd/topk_overlap"] = stats.topk_overlap
    if isinstance(batch.teacher, DenseTeacher):  # scored inside the step: agreement measured here
        metrics["teacher/top1_agreement"] = _top1_agreement(batch.teacher.logits, batch, tp_group)
        metrics["teacher/nonfinite_rows"] = _nonfinite_rows(batch.teacher.logits, tp_group)
    return per_token, metrics


@torch.no_grad()
def _topk_checks(teacher, v_local: int, tp_group) -> dict[str, torch.Tensor]:
    """For top-k rows, `teacher/invalid_rows`: 1 per row the loss's value checks would reject (ids out
    of range, NaN, an id twice). A check that raised here would make the host wait for the device
    in every micro-batch; the engine reads the step's sum once and refuses the update."""
    if not isinstance(teacher, TopKTeacher):
        return {}
    return {INVALID_ROWS: invalid_topk_rows(teacher, vocab=v_local * vp.group_size(tp_group))}


def _cross_tokenizer_kd(logits, batch, plan: LossPlan, tp_group):
    """The loss over aligned spans (`losses/cross_tokenizer.py`); metrics: the share of response
    tokens under each term, the exact term's teacher mass on the mapped ids, the ULD distance."""
    loss, teacher = plan.loss, batch.teacher
    kd = plan.kd_kwargs()
    per_token, stats = cross_tokenizer_loss(
        logits, teacher, _next_tokens(batch), teacher.teacher_to_student,
        mode=cross_tokenizer_mode(loss.cross_tokenizer),
        divergence=kd["divergence"], beta=kd["beta"], temperature=kd["temperature"], mass=kd["mass"],
        coverage_coef=kd["coverage_coef"], k=kd["k"], exact_weight=loss.gold_exact_weight,
        uld_weight=loss.gold_uld_weight, tp_group=tp_group, impl=plan.kd_impl)
    return per_token, {"xtok/exact_rows": stats.exact_rows.float(), "xtok/uld_rows": stats.uld_rows.float(),
                       "xtok/exact_teacher_mass": stats.teacher_mass, "xtok/uld": stats.uld}


@torch.no_grad()
def _nonfinite_rows(logits_local: torch.Tensor, tp_group) -> torch.Tensor:
    """1 for rows holding NaN on any vocabulary shard (a row max propagates NaN: no [N, V] mask)."""
    bad = torch.isnan(logits_local.amax(dim=1)).float()
    return vp.all_reduce_max_(bad, tp_group)


@torch.no_grad()
def _top1_agreement(teacher_logits_local: torch.Tensor, batch: PackedBatch, tp_group) -> torch.Tensor:
    """1 where the teacher's most likely next token is the sampled one (per row)."""
    top1 = vp.sharded_topk(teacher_logits_local, 1, tp_group)[:, 0]
    return (top1 == _next_tokens(batch)).float()


def _next_tokens(batch: PackedBatch) -> torch.Tensor:
    """Token t+1 for every row t (the last row's value is never counted: its loss mask is 0); a
    context-parallel rank's rows carry theirs (the next token may sit on another rank)."""
    return torch.roll(batch.tokens, -1) if batch.next_tokens is None else batch.next_tokens


def _policy_gradient(logits, batch, loss: LossSection):
    targets = _next_tokens(batch)
    # the student at T=1, like the rollout engine's raw logprobs: the importance ratio compares
    # the same quantity for the old and the new policy whatever the sampling temperature
    student_lp = _token_logprobs(logits, targets)
    if isinstance(batch.teacher, DenseTeacher):
        teacher_lp = _token_logprobs(batch.teacher.logits.float(), targets).detach()
    else:
        teacher_lp = _teacher_token_logprobs(batch.teacher, targets)
    task_adv = None
    if loss.task_reward_coef and batch.task_advantages is not None:
        task_adv = loss.task_reward_coef * batch.task_advantages
    old_lp = batch.sampler_logprobs
    if old_lp is None:  # step_report.reads_sampler_logprobs asks the engine for them in this form
        raise RuntimeError("loss.form = policy_gradient: the samples carry no sampler logprobs")
    out = policy_gradient_kd_loss(student_lp, old_lp, teacher_lp, estimator=loss.kl_estimator,
                                  kl_coef=loss.pg_coef, clip_ratio=loss.clip_eps, task_advantages=task_adv)
    metrics = {"pg/sampled_kl": (student_lp - teacher_lp).detach(),
               "pg/clip_fraction": out.clipped.float(),
               "pg/abs_log_ratio": (student_lp.detach() - old_lp).abs()}
    return out.loss, metrics
