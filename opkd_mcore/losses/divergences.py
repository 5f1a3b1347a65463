"""Divergences between two distributions over a set of outcomes: values and gradients.

Pure functions, no collectives and no autograd: the vocab-parallel autograd Functions call them
on either a vocabulary shard (then sum the per-outcome terms over the TP group) or on a small
replicated support set (top-k ids, optionally plus a tail outcome).

Inputs are log-probabilities `logP` (teacher) and `logQ` (student) of the same shape `[N, C]`;
an outcome that does not exist has `logP = logQ = -inf` and contributes nothing. Gradients are
w.r.t. the logits `u` of `Q = softmax(u)` over the outcome set:

| divergence | value | dD/du_j |
| --- | --- | --- |
| forward KL(P||Q) | sum P (log P - log Q) | Q_j - P_j |
| reverse KL(Q||P) | sum Q (log Q - log P) | Q_j (log Q_j - log P_j - KL(Q||P)) |
| JSD_beta | beta KL(P||M) + (1-beta) KL(Q||M) | (1-beta) Q_j (log Q_j/M_j - KL(Q||M)) |

with M = beta P + (1-beta) Q. The scalar in the reverse-KL / JSD gradient is a sum over *all*
outcomes; with a sharded vocabulary it is all-reduced before `divergence_grad` runs. Following
the GKD reference trainer, beta = 0 is the unscaled forward KL and beta = 1 the unscaled reverse
KL (JSD itself tends to 0 at both ends).
"""
from __future__ import annotations

import math

import torch

# the beta = 0 / 1 convention, defined once with the kernels (which may not import this package)
from opkd_kernels.sparse_objective import effective_divergence  # noqa: F401  (re-exported)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def weighted_log_ratio(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """`a * (log a - log b)` per outcome, defined as 0 where `a = 0` (including both -inf)."""
    present = log_a > float("-inf")
    safe_a = torch.where(present, log_a, torch.zeros_like(log_a))
    terms = torch.exp(safe_a) * (safe_a - log_b)
    return torch.where(present, terms, torch.zeros_like(terms))


def log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log(beta P + (1 - beta) Q) for 0 < beta < 1."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


def divergence_terms(log_p: torch.Tensor, log_q: torch.Tensor, divergence: str, beta: float
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-outcome terms `(value_terms, scalar_terms)`; summing each over all outcomes gives the
    divergence value and the scalar `divergence_grad` needs (`None` when it needs none)."""
    kind = effective_divergence(divergence, beta)
    if kind == "forward_kl":
        return weighted_log_ratio(log_p, log_q), None
    if kind == "reverse_kl":
        terms = weighted_log_ratio(log_q, log_p)
        return terms, terms
    log_m = log_mixture(log_p, log_q, beta)
    q_terms = weighted_log_ratio(log_q, log_m)
    return beta * weighted_log_ratio(log_p, log_m) + (1.0 - beta) * q_terms, q_terms


def divergence_grad(log_p: torch.Tensor, log_q: torch.Tensor, scalar_N: torch.Tensor | None,
                    divergence: str, beta: float) -> torch.Tensor:
    """dD/du over the outcomes (see the module table); `scalar_N` is the summed scalar term."""
    kind = effective_divergence(divergence, beta)
    q = torch.exp(log_q)
    if kind == "forward_kl":
        return q - torch.exp(log_p)
    if kind == "reverse_kl":
        inner = log_q - log_p - scalar_N[:, None]
    else:
        inner = log_q - log_mixture(log_p, log_q, beta) - scalar_N[:, None]
        q = (1.0 - beta) * q
    grad = q * inner
    return torch.where(q > 0, grad, torch.zeros_like(grad))


def divergence_grad_(log_p: torch.Tensor, log_q: torch.Tensor, scalar_N: torch.Tensor | None,
                     divergence: str, beta: float) -> torch.Tensor:
    """`divergence_grad` for vocabulary-sized buffers: overwrites `log_p` and `log_q` (and returns
    one of them) so that the gradient needs no more than two extra `[N, V_local]` temporaries."""
    kind = effective_divergence(divergence, beta)
    if kind == "forward_kl":
        return log_q.exp_().sub_(log_p.exp_())
    if kind == "reverse_kl":
        inner = log_p.neg_().add_(log_q).sub_(scalar_N[:, None])
        q = log_q.exp_()
    else:
        inner = torch.logaddexp(log_p.add_(math.log(beta)), log_q + math.log1p(-beta))
        inner.neg_().add_(log_q).sub_(scalar_N[:, None])
        q = log_q.exp_().mul_(1.0 - beta)
    # where q = 0 the inner term may be NaN (-inf - -inf); those entries have gradient 0
    return inner.mul_(q).masked_fill_(q == 0, 0.0)


def jsd_row_sums_(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums `(value, KL(Q||M))` of JSD_beta (0 < beta < 1) for vocabulary-sized buffers;
    overwrites `log_p` and keeps the peak at three extra `[N, V_local]` temporaries."""
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    q = log_q.exp()
    q_terms = (log_q - log_m).mul_(q).masked_fill_(q == 0, 0.0)
    del q
    kl_qm = q_terms.sum(dim=1)
    del q_terms
    p = log_p.exp()
    p_terms = log_p.sub_(log_m).mul_(p).masked_fill_(p == 0, 0.0)
    return beta * p_terms.sum(dim=1) + (1.0 - beta) * kl_qm, kl_qm
