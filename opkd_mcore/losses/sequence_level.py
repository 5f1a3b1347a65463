"""Sequence-level pieces of on-policy distillation: TCAD confidence weights, sampled-token KL and
the policy-gradient form of on-policy distillation (Thinking-Machines / verl-style k1 advantages).

Shape legend: T tokens of a packed batch, B sequences (rollouts).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

ESTIMATORS = ("k1", "k3")


def teacher_confidence_scores(teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor,
                              num_seqs: int) -> torch.Tensor:
    """TCAD's s_i: mean teacher log-probability of rollout i's response tokens, `[B]`.

    `teacher_logprobs [T]` is log p_T(y_{t+1}) at each position, `loss_mask [T]` marks response
    tokens, `seq_ids [T]` the rollout of each token. Rollouts without a response token score 0.
    """
    if not (teacher_logprobs.shape == loss_mask.shape == seq_ids.shape and teacher_logprobs.dim() == 1):
        raise ValueError("teacher_logprobs, loss_mask, seq_ids: expected three [T] tensors of one shape, got "
                         f"{tuple(teacher_logprobs.shape)}, {tuple(loss_mask.shape)}, {tuple(seq_ids.shape)}")
    mask = loss_mask.to(teacher_logprobs.dtype)
    values = torch.where(loss_mask.bool(), teacher_logprobs, torch.zeros_like(teacher_logprobs))
    sums = teacher_logprobs.new_zeros(num_seqs).index_add_(0, seq_ids.long(), values)
    counts = teacher_logprobs.new_zeros(num_seqs).index_add_(0, seq_ids.long(), mask)
    return (sums / counts.clamp(min=1)).detach()


def teacher_confidence_weights(scores: torch.Tensor, group_ids: torch.Tensor, alpha: float) -> torch.Tensor:
    """TCAD weights `[B]`: softmax(alpha * score) within each prompt's group, stop-gradient.

    Works for any layout: the rollouts of a prompt need not be adjacent and groups may have
    different sizes (the reference recipe required micro-batch = n rollouts of one prompt).
    Weights sum to 1 per group; alpha = 0 is uniform (1 / group size).
    """
    if scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(f"scores: expected a 1-D floating tensor [B], got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if group_ids.shape != scores.shape or group_ids.is_floating_point():
        raise ValueError(f"group_ids: expected an integer tensor of shape {tuple(scores.shape)} (one prompt "
                         f"index per score), got {group_ids.dtype} {tuple(group_ids.shape)}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ValueError(f"alpha: expected a finite number, got {alpha!r}")
    if torch.isnan(scores).any():
        raise ValueError("scores: contains NaN")
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    logits = (alpha * scores.detach()).to(torch.float64 if scores.dtype == torch.float64 else torch.float32)
    group_max = logits.new_full((num_groups,), float("-inf")).scatter_reduce(0, group, logits, "amax")
    exp = torch.exp(logits - group_max[group])
    group_sum = logits.new_zeros(num_groups).index_add_(0, group, exp)
    return (exp / group_sum[group]).to(scores.dtype)


def sampled_token_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                     estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(q||p) estimate at the sampled tokens y_t ~ q, `[T]`.

    k1 = log q(y) - log p(y) (unbiased, can be negative); k3 = e^d - d - 1 with d = log p - log q
    (non-negative, lower variance). Differentiable w.r.t. both inputs.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"teacher_logprobs: expected shape {tuple(student_logprobs.shape)} (that of "
                         f"student_logprobs), got {tuple(teacher_logprobs.shape)}")
    if estimator == "k1":
        return student_logprobs - teacher_logprobs
    delta = teacher_logprobs - student_logprobs
    return torch.expm1(delta) - delta


class PolicyGradientKDOutput(NamedTuple):
    """loss: per-token loss `[T]` to aggregate; advantages: the (detached) advantages used;
    clipped: bool `[T]`, where the PPO clip was active (for a clip-fraction metric)."""

    loss: torch.Tensor
    advantages: torch.Tensor
    clipped: torch.Tensor


def policy_gradient_kd_loss(student_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                            teacher_logprobs: torch.Tensor, *, estimator: str = "k1", kl_coef: float = 1.0,
                            clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                            task_advantages: torch.Tensor | None = None,
                            policy_gradient: bool = True) -> PolicyGradientKDOutput:
    """On-policy distillation through a policy gradient on the sampled tokens.

    Advantage A_t = -kl_coef * k_t (detached), plus `task_advantages` (e.g. GRPO) when given, fed to
    PPO-clip with the sampler's `old_logprobs` as the old policy:
    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio, 1 + clip_ratio_high)), r_t = e^(log q - log q_old).

    `policy_gradient=False` instead returns `kl_coef * k3` as a direct, differentiable loss; k1 is
    rejected there because the gradient of log q(y) - log p(y) w.r.t. the student has expectation
    zero under y ~ q and carries no teacher signal.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    for name, x in (("old_logprobs", old_logprobs), ("teacher_logprobs", teacher_logprobs),
                    ("task_advantages", task_advantages)):
        if x is not None and x.shape != student_logprobs.shape:
            raise ValueError(f"{name}: expected shape {tuple(student_logprobs.shape)} (that of "
                             f"student_logprobs), got {tuple(x.shape)}")
    if not policy_gradient:
        if estimator == "k1":
            raise ValueError("estimator: 'k1' without policy_gradient has no teacher gradient (its gradient "
                             "is -grad log q(y), zero in expectation); use policy_gradient=True or 'k3'")
        kl = kl_coef * sampled_token_kl(student_logprobs, teacher_logprobs, estimator)
        no_clip = torch.zeros_like(kl, dtype=torch.bool)
        return PolicyGradientKDOutput(kl, torch.zeros_like(kl).detach(), no_clip)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if not (clip_ratio >= 0 and high >= 0):
        raise ValueError(f"clip_ratio: expected >= 0 (low and high), got {clip_ratio}, {high}")
    advantages = -kl_coef * sampled_token_kl(student_logprobs.detach(), teacher_logprobs.detach(), estimator)
    if task_advantages is not None:
        advantages = advantages + task_advantages.detach()
    ratio = torch.exp(student_logprobs - old_logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + high)
    return PolicyGradientKDOutput(torch.maximum(unclipped, clipped), advantages, clipped > unclipped)
