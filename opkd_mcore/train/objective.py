"""The student's loss on one packed micro-batch, as the engine's `loss_fn(logits_local, batch)`.

Only positions with `loss_mask == 1` (those predicting a response token) are scored. The scalar is
normalised by the *global* count of the step (tokens or sequences, per `loss.aggregation`), so
micro-batch size, gradient accumulation and DP do not change the loss scale. Metrics are returned
as sums already divided by that same global count, so the engine can add them over micro-batches
and DP ranks and get step means.
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from opkd_mcore.config.schema import LossSection
from opkd_mcore.config.validate import fused_lm_head_mode
from opkd_mcore.engine.lm_head import LmHeadInput
from opkd_mcore.engine.packing import PackedBatch
from opkd_mcore.losses import (
    DenseTeacher,
    HiddenTeacher,
    TopKTeacher,
    aggregate,
    aggregate_row_weights,
    kd_loss_with_stats,
    linear_kd_loss_weighted,
    linear_kd_loss_with_stats,
    policy_gradient_kd_loss,
)
from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.fused_linear import engine_name, hidden_teacher_logits

logger = logging.getLogger(__name__)


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


def make_loss_fn(loss: LossSection, counts: StepCounts, tp_group=None):
    """`loss_fn(logits_local [T, V_local], batch) -> (scalar, metrics)` for the engine.

    The loss runs on all T rows of the micro-batch and `loss_mask` selects the response rows:
    gathering those rows first would copy the logits (and their gradient) once more.
    """

    def loss_fn(logits_local: torch.Tensor | LmHeadInput, batch: PackedBatch):
        mask = batch.loss_mask
        agg = {"mode": loss.aggregation, "global_num_tokens": counts.num_tokens,
               "global_num_seqs": counts.num_seqs, "seq_weights": batch.sequence_weights,
               "num_seqs": batch.num_sequences}
        scalar = None
        if isinstance(logits_local, LmHeadInput):  # the fused LM head: hidden states + weight shard
            row_weights = None
            if lm_head_engine(loss, batch.teacher, logits_local.hidden) == "rows":   # the scalar's weights, before the loss
                row_weights = aggregate_row_weights(mask, batch.seq_ids, **agg)
            per_token, metrics, scalar = _fused_head_kd(logits_local, batch, loss, tp_group, row_weights)
        elif isinstance(batch.teacher, HiddenTeacher):  # fused head off: the teacher's logits, formed here
            batch = copy.copy(batch)
            batch.teacher = DenseTeacher(hidden_teacher_logits(batch.teacher, tp_group, dtype=logits_local.dtype))
            return loss_fn(logits_local, batch)
        elif loss.form == "policy_gradient":
            per_token, metrics = _policy_gradient(logits_local, batch, loss)
        else:
            per_token, metrics = _distribution_kd(logits_local, batch, loss, tp_group)
        if scalar is None:
            scalar = aggregate(per_token, mask, batch.seq_ids, **agg)
        denom = float(counts.num_tokens)
        counted = mask.bool()
        out = {name: torch.where(counted, value.detach().float(), 0.0).sum() / denom
               for name, value in metrics.items()}
        out["kd/per_token_loss"] = torch.where(counted, per_token.detach(), 0.0).sum() / denom
        out["train/response_tokens"] = mask.sum()
        return scalar, out

    # the engine asks, per micro-batch, whether to hand over hidden states instead of logits
    loss_fn.lm_head_plan = functools.partial(fused_lm_head_plan, loss)
    return loss_fn


# ---------------------------------------------------------------- the fused LM head
def _engine_impl(impl: str) -> str:
    return {"fused": "auto"}.get(impl, impl)


@functools.lru_cache(maxsize=None)
def _say_lm_head(decision: str) -> None:
    logger.info("loss.fused_lm_head: %s", decision)


def _lm_head_not_covered(loss: LossSection, teacher) -> str | None:
    if loss.form != "logit":
        return "loss.form: policy_gradient scores the sampled token from materialised logits"
    if loss.impl == "reference":
        return "loss.impl: reference materialises the logits"
    if isinstance(teacher, DenseTeacher):
        return "the teacher hands over full-vocabulary logits (output: dense)"
    return None   # top-k rows, hidden states, or the in-step Megatron teacher (None until the step)


def fused_lm_head_plan(loss: LossSection, batch: PackedBatch, device, dtype: torch.dtype) -> bool:
    """True when the step should run the output layer inside the loss for `batch` (`loss_fn` then
    gets an `LmHeadInput`). `auto`: where the Triton tiles run and the objective and teacher are
    covered; the chunked twin on CPU / NPU trades one more pass for memory, so it is on only when
    asked for (`on`). The decision is logged once."""
    mode = fused_lm_head_mode(loss.fused_lm_head)
    if mode == "off":
        _say_lm_head("off (loss.fused_lm_head: off)")
        return False

    why = _lm_head_not_covered(loss, batch.teacher)
    engine = None
    if why is None:
        # engine_name reads only these two attributes: no allocation on the device
        engine = engine_name(SimpleNamespace(device=torch.device(device), dtype=dtype), _engine_impl(loss.impl))
        if engine is None:
            why = f"no fused LM-head kernel takes {dtype}"
        elif mode == "auto" and engine != "triton":
            why = f"auto turns it on where the Triton tiles run; here the chunked {engine} twin would (use on)"
        elif loss.lm_head_engine == "tiles" and engine != "triton":
            why = f"loss.lm_head_engine: tiles needs the Triton kernels; here the chunked {engine} twin runs"
    if why is not None:
        if mode == "on":
            raise ValueError(f"loss.fused_lm_head: 'on' cannot run: {why}")
        _say_lm_head(f"off ({why})")
        return False
    _say_lm_head(f"on ({engine} kernels, lm_head_engine: {loss.lm_head_engine})")
    return True


def lm_head_engine(loss: LossSection, teacher, hidden=None) -> str | None:
    """The fused LM head's engine for `teacher` and the student's `hidden` rows (a tensor, or anything
    with its `device` and `dtype`): "rows", "chunked", or None for `loss.impl`'s choice (the Triton
    tiles on a GPU, the chunked twin elsewhere). `auto` takes `rows` where the Triton kernels run:
    forming the logits once per chunk of rows and the gradients in the forward does the 4 GEMMs of
    the unfused path instead of 6, 1.07-1.24x the GEMMs alone against 1.85-2.7x for the recomputing
    engines, with ~1.2 GiB of chunk buffers (docs/benchmarks.md, 2026-11-25 H100). Elsewhere `auto`
    keeps the chunked twin, which holds one [rows, 4096] block. A named engine is taken as asked
    (`rows` on any device, `loss.impl` picking its logits kernels); a named twin (cpp / torch)
    is never overridden."""
    impl = _engine_impl(loss.impl)
    if loss.lm_head_engine == "rows":
        return "rows"
    if impl not in ("auto", "triton"):   # cpp / torch named: the twin, as asked
        return None
    if loss.lm_head_engine == "chunked":
        return "chunked"
    if loss.lm_head_engine == "auto":
        if hidden is not None and engine_name(hidden, impl) == "triton":
            return "rows"
        if isinstance(teacher, HiddenTeacher) and loss.support is None:
            return "chunked"
    return None


def _fused_head_kd(head: LmHeadInput, batch, loss: LossSection, tp_group, row_weights=None):
    """`kd_loss` of the logits `head.hidden @ head.weight.T`, never formed whole: (per-token
    loss, metrics, scalar). With `row_weights` (the rows engine) the scalar is `sum(row_weights *
    loss)`, back-propagated as is; without, None (the caller aggregates the per-token loss)."""
    teacher = batch.teacher
    if isinstance(teacher, HiddenTeacher) and teacher.hidden.dtype != head.hidden.dtype:
        # served rows arrive in bf16; the kernels take one operand dtype (the student's)
        teacher = HiddenTeacher(teacher.hidden.to(head.hidden.dtype), teacher.weight.to(head.hidden.dtype),
                                teacher.vocab_size)
    kd = {"divergence": loss.divergence, "beta": loss.beta, "temperature": loss.temperature,
          "support": loss.support, "k": loss.k, "mass": loss.mass, "coverage_coef": loss.coverage_coef,
          "tp_group": tp_group, "impl": _engine_impl(loss.impl), "validate": isinstance(teacher, TopKTeacher),
          "vocab_end": head.vocab_size}
    scalar = None
    if row_weights is not None:
        chunk_bytes = None if loss.lm_head_chunk_mb is None else loss.lm_head_chunk_mb << 20
        scalar, per_token, stats = linear_kd_loss_weighted(head.hidden, head.weight, teacher, row_weights,
                                                           chunk_bytes=chunk_bytes, **kd)
    else:
        per_token, stats = linear_kd_loss_with_stats(head.hidden, head.weight, teacher,
                                                     engine=lm_head_engine(loss, teacher, head.hidden), **kd)
    metrics = {"kd/teacher_mass_on_support": stats.teacher_mass,
               "kd/student_mass_on_support": stats.student_mass}
    if isinstance(teacher, HiddenTeacher):  # dense teacher: agreement and NaN rows from the stats pass
        metrics["teacher/top1_agreement"] = (stats.teacher_top1 == _next_tokens(batch)).float()
        metrics["teacher/nonfinite_rows"] = torch.isnan(stats.lse[:, 1]).float()
    return per_token, metrics, scalar


def _distribution_kd(logits, batch, loss: LossSection, tp_group):
    per_token, stats = kd_loss_with_stats(
        logits, batch.teacher, divergence=loss.divergence, beta=loss.beta, temperature=loss.temperature,
        support=loss.support, k=loss.k, mass=loss.mass, coverage_coef=loss.coverage_coef,
        tp_group=tp_group, impl=loss.impl,
        # top-k rows are cheap to check here; dense rows were checked where they were made
        # (a NaN scan of [N, V] logits would cost a full-size mask)
        validate=not isinstance(batch.teacher, DenseTeacher))
    metrics = {"kd/teacher_mass_on_support": stats.teacher_mass,
               "kd/student_mass_on_support": stats.student_mass}
    if stats.topk_overlap is not None:
        metrics["kd/topk_overlap"] = stats.topk_overlap
    if isinstance(batch.teacher, DenseTeacher):  # scored inside the step: agreement measured here
        metrics["teacher/top1_agreement"] = _top1_agreement(batch.teacher.logits, batch, tp_group)
        metrics["teacher/nonfinite_rows"] = _nonfinite_rows(batch.teacher.logits, tp_group)
    return per_token, metrics


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
    """Token t+1 for every row t (the last row's value is never counted: its loss mask is 0)."""
    return torch.roll(batch.tokens, -1)


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
    out = policy_gradient_kd_loss(student_lp, old_lp, teacher_lp, estimator=loss.kl_estimator,
                                  kl_coef=loss.pg_coef, clip_ratio=loss.clip_eps, task_advantages=task_adv)
    metrics = {"pg/sampled_kl": (student_lp - teacher_lp).detach(),
               "pg/clip_fraction": out.clipped.float(),
               "pg/abs_log_ratio": (student_lp.detach() - old_lp).abs()}
    return out.loss, metrics
