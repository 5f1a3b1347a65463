"""The distillation objective on a sparse support S, as a function of K student values.

Every sparse objective of `kd_loss` (top-k teacher or TCAD truncation; renorm / tail / raw mass;
coverage) depends on the student only through
    s_S  [N, K]  the student's scaled logits at the support ids, and
    lse  [N]     the student's full-vocabulary log-partition logsumexp(z / T).
So the full-vocabulary gradient is  dL/dz_j = dL/dlse * q_j + dL/ds_S[k] * [j = S_k],  which the
fused kernels write in one pass. This file computes L and (dL/ds_S, dL/dlse) with torch autograd
on the small `[N, K]` tensors, identically on every TP rank (they are replicated after the
gather). Padding entries (`valid == False`) are outside S; a row without any valid entry has
loss 0 and gradient 0. `kd_sparse_objective.py` is the one-launch Triton form of this function,
tested against it.

Why the trainer's reference path (`opkd_mcore/losses/support_kd.py`: `impl="reference"`, float64
logits, whatever no fused kernel covers) computes the same objective its own way: it holds the
shard's logits, so it takes the log-partition off S exactly (the tail masses without cancellation)
and writes analytic gradient coefficients in the logits' compute dtype. The fused kernels never
hold the logits; from s_S and lse alone the tail is 1 - exp(lse_S - lse), which needs float64 to
resolve the tail of a peaked distribution, and autograd on the small `[N, K]` problem gives the
K + 1 partials. Both are tested against `tests/losses_reference.py`.
"""
from __future__ import annotations

import math

import torch

# Teacher tail floor: reverse KL / JSD with a tail bucket stay finite when the teacher put
# (numerically) all its mass on S; 1e-12 is far below any mass that matters. The trainer's
# reference path (losses/support_kd.py) imports it from here.
TEACHER_TAIL_FLOOR = 1e-12
# Student tail floor: only hit when the student's mass on S rounds to 1 in float32.
STUDENT_TAIL_FLOOR = 1e-30


def effective_divergence(divergence: str, beta: float) -> str:
    """JSD at beta 0 / 1 is the unscaled forward / reverse KL (GKD reference convention)."""
    if divergence == "jsd" and beta == 0.0:
        return "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        return "reverse_kl"
    return divergence


def _xlogratio(log_a: torch.Tensor, log_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum over the row of a (log a - log b) on `mask`, with 0 log 0 = 0 and no NaN gradients."""
    present = mask & (log_a > float("-inf"))
    safe_a = torch.where(present, log_a, torch.zeros_like(log_a))
    safe_b = torch.where(present, log_b, torch.zeros_like(log_b))
    terms = torch.exp(safe_a) * (safe_a - safe_b)
    return torch.where(present, terms, torch.zeros_like(terms)).sum(dim=1)


def divergence(log_p: torch.Tensor, log_q: torch.Tensor, mask: torch.Tensor, kind: str,
               beta: float) -> torch.Tensor:
    """D(P||Q) per row over the outcomes in `mask` (log-probabilities `[N, C]`)."""
    kind = effective_divergence(kind, beta)
    if kind == "forward_kl":
        return _xlogratio(log_p, log_q, mask)
    if kind == "reverse_kl":
        return _xlogratio(log_q, log_p, mask)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * _xlogratio(log_p, log_m, mask) + (1.0 - beta) * _xlogratio(log_q, log_m, mask)


def _masked_logsumexp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.masked_fill(~mask, float("-inf")), dim=1)


def _log1mexp(log_x: torch.Tensor, floor: float) -> torch.Tensor:
    """log(1 - exp(log_x)), floored at log(floor)."""
    return torch.log(torch.clamp(-torch.expm1(torch.clamp(log_x, max=0.0)), min=floor))


def sparse_objective(s_S: torch.Tensor, lse: torch.Tensor, log_p_S: torch.Tensor, valid: torch.Tensor,
                     kind: str, beta: float, mass: str, coverage_coef: float) -> torch.Tensor:
    """Loss `[N]` from student values `s_S [N, K]`, `lse [N]` and teacher log-probs `log_p_S [N, K]`."""
    empty = ~valid.any(dim=1)
    # An all-padding row is given one fake entry so that every intermediate stays finite; its
    # loss is zeroed at the end (a finite branch of torch.where back-propagates exact zeros).
    valid = valid.clone()
    valid[:, 0] |= empty
    log_p_S = torch.where(valid, log_p_S, float("-inf"))
    log_p_S[:, 0] = torch.where(empty, torch.zeros_like(log_p_S[:, 0]), log_p_S[:, 0])
    s_S = torch.where(valid, s_S, torch.zeros_like(s_S))

    log_q_S = s_S - lse[:, None]
    lse_S = _masked_logsumexp(s_S, valid)
    log_mq = lse_S - lse
    log_mp = _masked_logsumexp(log_p_S, valid)
    if mass == "raw":
        loss = _xlogratio(log_p_S, log_q_S, valid)
    elif mass == "renorm":
        log_P = log_p_S - log_mp[:, None]
        log_Q = s_S - lse_S[:, None]
        loss = divergence(log_P, log_Q, valid, kind, beta)
    elif mass == "tail":
        log_P = torch.cat([log_p_S, _log1mexp(log_mp, TEACHER_TAIL_FLOOR)[:, None]], dim=1)
        log_Q = torch.cat([log_q_S, _log1mexp(log_mq, STUDENT_TAIL_FLOOR)[:, None]], dim=1)
        mask = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        loss = divergence(log_P, log_Q, mask, kind, beta)
    else:
        raise ValueError(f"mass: expected one of ('renorm', 'tail', 'raw'), got {mass!r}")
    if coverage_coef:
        loss = loss - coverage_coef * log_mq
    return torch.where(empty, torch.zeros_like(loss), loss)


# Entries of the float64 objective evaluated at once: its autograd keeps ~15 float64 temporaries
# per entry, so 2**22 entries (K=256: 16384 rows) bound them near 0.5 GB whatever N is. Smaller
# chunks cost ~2 ms each of kernel launches on an H200 (2**20 made K=256, N=16384 2x slower).
CHUNK_ENTRIES = 1 << 22


def sparse_objective_and_grads(s_S: torch.Tensor, lse: torch.Tensor, log_p_S: torch.Tensor,
                               valid: torch.Tensor, kind: str, beta: float, mass: str,
                               coverage_coef: float, need_grad: bool = True):
    """(loss [N], dL/ds_S [N, K] or None, dL/dlse [N] or None) in the dtype of `s_S`.

    Rows are independent, so the gradient of the summed loss gives every row's own partials;
    they are evaluated in chunks of rows to bound the float64 temporaries.
    """
    n, k = s_S.shape
    rows = max(1, CHUNK_ENTRIES // max(k, 1))
    if n <= rows:
        return _objective_and_grads(s_S, lse, log_p_S, valid, kind, beta, mass, coverage_coef, need_grad)
    loss = s_S.new_empty(n)
    d_s = s_S.new_empty(n, k) if need_grad else None
    d_lse = s_S.new_empty(n) if need_grad else None
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        part = _objective_and_grads(s_S[lo:hi], lse[lo:hi], log_p_S[lo:hi], valid[lo:hi], kind, beta,
                                    mass, coverage_coef, need_grad)
        loss[lo:hi] = part[0]
        if need_grad:
            d_s[lo:hi], d_lse[lo:hi] = part[1], part[2]
    return loss, d_s, d_lse


def _objective_and_grads(s_S, lse, log_p_S, valid, kind, beta, mass, coverage_coef, need_grad):
    # float64 on [N, K] is cheap, and a tail mass 1 - sum_S p of a peaked teacher is far below
    # float32's resolution of sum_S p.
    out_dtype = s_S.dtype
    with torch.enable_grad():
        s_leaf = s_S.detach().double().requires_grad_(need_grad)
        lse_leaf = lse.detach().double().requires_grad_(need_grad)
        loss = sparse_objective(s_leaf, lse_leaf, log_p_S.detach().double(), valid, kind, beta, mass,
                                coverage_coef)
        if not need_grad:
            return loss.detach().to(out_dtype), None, None
        d_s, d_lse = torch.autograd.grad(loss.sum(), (s_leaf, lse_leaf), allow_unused=True)
    # renorm without coverage does not depend on the full-vocabulary log-partition at all
    d_s = torch.zeros_like(s_leaf) if d_s is None else d_s
    d_lse = torch.zeros_like(lse_leaf) if d_lse is None else d_lse
    return loss.detach().to(out_dtype), d_s.to(out_dtype), d_lse.to(out_dtype)
