"""Brute-force float64 reference for `kd_loss`: full vocabulary on one process, plain autograd.

Deliberately written differently from `opkd_mcore.losses`: the support is a boolean mask over the
full vocabulary, every token row is handled on its own in a Python loop, distributions are built
by indexing, and gradients come from autograd. Slow; meant for small N and V only.

    reference_kd_loss(student_logits_full [N, V], teacher_full_or_topk, **same kwargs as kd_loss)
        -> float64 [N], differentiable w.r.t. student_logits_full

`teacher_full_or_topk` is a `DenseTeacher` with full `[N, V]` logits or a `TopKTeacher`.
Kernel tests and benchmarks import this module too.
"""
from __future__ import annotations

import torch

from opkd_mcore.losses.teacher_outputs import DenseTeacher, TopKTeacher

TEACHER_TAIL_FLOOR = 1e-12  # the documented floor of the teacher's tail mass (see docs/losses.md)


def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a||b) of two 1-D log-distributions; outcomes with a = 0 are dropped."""
    keep = log_a > float("-inf")
    return (log_a[keep].exp() * (log_a[keep] - log_b[keep])).sum()


def divergence(log_p: torch.Tensor, log_q: torch.Tensor, name: str, beta: float) -> torch.Tensor:
    if name == "forward_kl" or (name == "jsd" and beta == 0.0):
        return kl(log_p, log_q)
    if name == "reverse_kl" or (name == "jsd" and beta == 1.0):
        return kl(log_q, log_p)
    log_m = torch.logaddexp(log_p + torch.log(torch.tensor(beta, dtype=torch.float64)),
                            log_q + torch.log(torch.tensor(1 - beta, dtype=torch.float64)))
    return beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)


def teacher_log_probs(teacher, vocab: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocab teacher log-probs `[N, V]` (top-k: -inf off the ids) and a mask of the given ids."""
    if isinstance(teacher, DenseTeacher):
        log_p = torch.log_softmax(teacher.logits.double() / temperature, dim=-1)
        return log_p, torch.ones_like(log_p, dtype=torch.bool)
    n = teacher.ids.shape[0]
    log_p = torch.full((n, vocab), float("-inf"), dtype=torch.float64)
    given = torch.zeros(n, vocab, dtype=torch.bool)
    for row in range(n):
        for tok, lp in zip(teacher.ids[row].tolist(), teacher.logprobs[row].double().tolist()):
            if tok >= 0:
                log_p[row, tok] = lp
                given[row, tok] = True
    return log_p, given


def support_mask(log_p, log_q, given, teacher, support, k) -> torch.Tensor:
    """Bool `[N, V]`: the support S of every row."""
    n, vocab = log_p.shape
    mask = torch.zeros(n, vocab, dtype=torch.bool)
    for row in range(n):
        if isinstance(teacher, TopKTeacher):
            ids = [i for i in range(vocab) if given[row, i]]
            if k is not None and k < len(teacher.ids[row]):
                ids = sorted(ids, key=lambda i: -log_p[row, i].item())[:k]
        else:
            ids = torch.argsort(log_p[row], descending=True)[:k].tolist()
            if support == "union":
                ids += torch.argsort(log_q[row].detach(), descending=True)[:k].tolist()
        mask[row, ids] = True
    return mask


def reference_kd_loss(student_logits_full, teacher, *, divergence="forward_kl", beta=0.5, temperature=1.0,
                      support=None, k=None, mass="renorm", coverage_coef=0.0, **_ignored) -> torch.Tensor:
    z = student_logits_full.double() / temperature
    log_q = torch.log_softmax(z, dim=-1)
    log_p, given = teacher_log_probs(teacher, z.shape[1], temperature)
    if support is None:
        return torch.stack([_div(log_p[r], log_q[r], divergence, beta) for r in range(z.shape[0])])
    mask = support_mask(log_p, log_q, given, teacher, support, k)
    rows = []
    for r in range(z.shape[0]):
        s = mask[r]
        if not s.any():
            rows.append(z[r].sum() * 0.0)
            continue
        lp_s, lq_s = log_p[r][s], log_q[r][s]
        if mass == "raw":
            value = (lp_s.exp() * (lp_s - lq_s)).sum()
        elif mass == "renorm":
            value = _div(lp_s - lp_s.logsumexp(0), lq_s - lq_s.logsumexp(0), divergence, beta)
        else:
            value = _div(torch.cat([lp_s, _teacher_tail(log_p[r], s, teacher)[None]]),
                         torch.cat([lq_s, log_q[r][~s].logsumexp(0)[None]]), divergence, beta)
        if coverage_coef:
            value = value - coverage_coef * lq_s.logsumexp(0)
        rows.append(value)
    return torch.stack(rows)


def _div(log_p, log_q, name, beta):
    return divergence(log_p, log_q, name, beta)


def _teacher_tail(log_p_row, s, teacher) -> torch.Tensor:
    if isinstance(teacher, DenseTeacher):
        tail = log_p_row[~s].logsumexp(0) if (~s).any() else torch.tensor(float("-inf"), dtype=torch.float64)
    else:
        tail = torch.log(torch.clamp(1.0 - log_p_row[s].exp().sum(), min=0.0))
    return torch.clamp(tail, min=torch.log(torch.tensor(TEACHER_TAIL_FLOOR, dtype=torch.float64)))
