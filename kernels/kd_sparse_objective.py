"""Triton kernel: the sparse-support objective and its closed-form gradients, one launch.

The same function as `sparse_objective.sparse_objective_and_grads` (the float64 torch-autograd
oracle, also the CPU path): per row n, from s_c = s_S[n, c], lse = lse[n], log p_c = log_p_S[n, c]
over the valid entries c of S (padding entries are outside S),
    lse_S = logsumexp_S s,  log m_q = lse_S - lse,  log m_p = logsumexp_S log p,
    Q^S_c = exp(s_c - lse_S)   (the student renormalised on S).
All math is float64 in registers (the inputs are float32; the outputs take the dtype of s_S).

The outcomes, with P the teacher and Q the student distribution over them:
    renorm   c in S:           log P_c = log p_c - log m_p,  log Q_c = s_c - lse_S
    tail     c in S:           log P_c = log p_c,            log Q_c = s_c - lse
             + tail outcome t: log P_t = log max(1 - m_p, 1e-12),  log Q_t = log max(1 - m_q, 1e-30)
             (1 - m = -expm1(min(log m, 0)); the max and min have zero gradient where they clip,
             like torch.clamp, whose bounds are inclusive)
    raw      L = sum_S p_c (log p_c - (s_c - lse))     (forward KL against the full-vocab q; the
             divergence kind is ignored, as in the torch version)
with 0 log 0 = 0 (an outcome with log P = -inf contributes nothing to P log(P/.)). Divergences
and g_c = dD/dlog Q_c (P held fixed):
    forward KL  D = sum P (log P - log Q)                          g_c = -P_c
    reverse KL  D = sum Q (log Q - log P)                          g_c = Q_c (log Q_c - log P_c + 1)
    JSD(b)      D = b sum P (log P - log M) + (1-b) sum Q (log Q - log M),  M = b P + (1-b) Q
                                                                   g_c = (1-b) Q_c (log Q_c - log M_c)
(JSD at b = 0 / 1 is the unscaled forward / reverse KL: `effective_divergence`). Chain rule, with
G = sum_{c in S} g_c:
    renorm  dL/ds_j = g_j - Q^S_j G                                dL/dlse = 0
    tail    dL/ds_j = g_j + g_t h Q^S_j                            dL/dlse = -G - g_t h
            with h = dlog Q_t / dlog m_q = -m_q / (1 - m_q)  (0 where the floor or the min clips)
    raw     dL/ds_j = -p_j                                         dL/dlse = sum_S p
    coverage  L -= c log m_q:  dL/ds_j -= c Q^S_j,  dL/dlse += c.
A row without a valid entry has loss 0 and gradient 0; padding entries get gradient 0.

expm1 and log1p are computed in float64 with the classic exact-rounding tricks (Kahan:
expm1(x) = (e^x - 1) x / log e^x; Goldberg: log1p(u) = log(1 + u) u / ((1 + u) - 1)); both work
compiled and under the interpreter. The two logsumexps are max + log1p(sum of the other terms),
so a tail mass 1 - m of 1e-9 keeps ~1e-14 relative accuracy (checked against mpmath); the torch
oracle's plain logsumexp loses ~1e-7 of it, which moves the smallest gradient entries of such a row
by up to a few 1e-6 relative. Elsewhere the two agree to 1e-12 relative on float64 inputs.
Float scalars are passed as float64 (`tl.float64` annotations) and re-materialised with
`tl.full(..., tl.float64)`, which keeps them exact under the interpreter too (a bare Python float
would be rounded to float32 there).

H200, N = 16384, K = 256 (fp32 in): 0.05 to 0.18 ms (JSD + tail the slowest) against 1.6 to 2.5 ms
for the torch version; launch shapes within noise of each other from 256 to 2048 entries a program.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._jit import interpreting, lazy_jit
from .sparse_objective import STUDENT_TAIL_FLOOR, TEACHER_TAIL_FLOOR, effective_divergence

_NEG_INF = tl.constexpr(float("-inf"))
_TEACHER_FLOOR = tl.constexpr(TEACHER_TAIL_FLOOR)
_STUDENT_FLOOR = tl.constexpr(STUDENT_TAIL_FLOOR)

KIND_CODES = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
MASS_CODES = {"renorm": 0, "tail": 1, "raw": 2}


def _kd_sparse_objective_kernel(
        s_ptr, lse_ptr, lp_ptr, valid_ptr, loss_ptr, ds_ptr, dlse_ptr, mp_ptr, mq_ptr,
        n_rows, K, s_rs, s_cs, lse_st, lp_rs, lp_cs, v_rs, v_cs,
        beta_arg: tl.float64, log_beta_arg: tl.float64, log1m_beta_arg: tl.float64,
        coverage_arg: tl.float64,
        KIND: tl.constexpr, MASS: tl.constexpr, COVERAGE: tl.constexpr, NEED_GRAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < n_rows
    r2 = rows[:, None]
    c2 = cols[None, :]
    in_blk = row_ok[:, None] & (c2 < K)
    v = tl.load(valid_ptr + r2 * v_rs + c2 * v_cs, mask=in_blk, other=0) != 0
    s = tl.load(s_ptr + r2 * s_rs + c2 * s_cs, mask=v, other=0.0).to(tl.float64)
    lp = tl.load(lp_ptr + r2 * lp_rs + c2 * lp_cs, mask=v, other=_NEG_INF).to(tl.float64)
    lse = tl.load(lse_ptr + rows * lse_st, mask=row_ok, other=0.0).to(tl.float64)
    nonempty = tl.max(v.to(tl.int32), axis=1) > 0
    one = tl.full([], 1.0, tl.float64)

    # student: lse_S = logsumexp_S s = max + log1p(sum of the other terms), which keeps m_q close
    # to 1 accurate (finite placeholder 0 on an empty row); Q^S = exp(s - lse_S), log m_q
    s_m = tl.where(v, s, _NEG_INF)
    s_max = tl.max(s_m, axis=1)
    s_max = tl.where(nonempty, s_max, 0.0)
    at_max = v & (s_m == s_max[:, None])
    rest_s = (tl.sum(at_max.to(tl.float64), axis=1) - 1.0) + tl.sum(
        tl.where(v & (s_m < s_max[:, None]), tl.exp(s - s_max[:, None]), 0.0), axis=1)
    rest_s = tl.maximum(rest_s, 0.0)
    w_s = 1.0 + rest_s
    lse_S = s_max + tl.where(w_s == 1.0, rest_s,
                             tl.log(w_s) * (rest_s / tl.where(w_s == 1.0, one, w_s - 1.0)))
    q_S = tl.where(v, tl.exp(s - lse_S[:, None]), 0.0)
    log_mq = lse_S - lse
    # teacher: log m_p = logsumexp_S log p, the same way (-inf when S holds no teacher mass)
    lp_max = tl.max(lp, axis=1)
    has_mp = lp_max > _NEG_INF
    lp_max = tl.where(has_mp, lp_max, 0.0)
    at_max_p = has_mp[:, None] & (lp == lp_max[:, None])
    rest_p = (tl.sum(at_max_p.to(tl.float64), axis=1) - 1.0) + tl.sum(
        tl.where(lp < lp_max[:, None], tl.exp(lp - lp_max[:, None]), 0.0), axis=1)
    rest_p = tl.maximum(rest_p, 0.0)
    w_p = 1.0 + rest_p
    log_mp = lp_max + tl.where(w_p == 1.0, rest_p,
                               tl.log(w_p) * (rest_p / tl.where(w_p == 1.0, one, w_p - 1.0)))
    log_mp = tl.where(has_mp, log_mp, _NEG_INF)

    if MASS == 0:
        log_P = lp - log_mp[:, None]
        log_Q = s - lse_S[:, None]
    else:
        log_P = lp
        log_Q = s - lse[:, None]
    P = tl.exp(log_P)
    Q = tl.exp(log_Q)
    has_p = v & (log_P > _NEG_INF)
    has_q = v & (log_Q > _NEG_INF)

    if MASS == 1:
        # 1 - m = -expm1(x), x = min(log m, 0) <= 0, by Kahan's expm1(x) = (u - 1) x / log u
        xp = tl.minimum(log_mp, 0.0)
        up = tl.exp(xp)
        near_p = (xp > -1.0) & (up != 1.0)
        em1_p = tl.where(near_p, (up - 1.0) * (xp / tl.log(tl.where(near_p, up, 0.5))), up - 1.0)
        em1_p = tl.where(up == 1.0, xp, em1_p)
        P_t = tl.maximum(-em1_p, tl.full([], _TEACHER_FLOOR, tl.float64))
        log_P_t = tl.log(P_t)
        xq = tl.minimum(log_mq, 0.0)
        uq = tl.exp(xq)
        near_q = (xq > -1.0) & (uq != 1.0)
        em1_q = tl.where(near_q, (uq - 1.0) * (xq / tl.log(tl.where(near_q, uq, 0.5))), uq - 1.0)
        em1_q = tl.where(uq == 1.0, xq, em1_q)
        y_q = -em1_q
        student_floor = tl.full([], _STUDENT_FLOOR, tl.float64)
        Q_t = tl.maximum(y_q, student_floor)
        log_Q_t = tl.log(Q_t)
        # d log Q_t / d log m_q; zero where either clamp clips (inclusive bounds, as torch.clamp)
        h = tl.where((log_mq <= 0.0) & (y_q >= student_floor), -uq / Q_t, 0.0)

    if MASS == 2:
        # raw: forward KL of p_S against the full-vocabulary q, whatever the kind
        loss = tl.sum(tl.where(has_p, P * (log_P - log_Q), 0.0), axis=1)
        g = tl.where(has_p, -P, 0.0)
    elif KIND == 0:
        loss = tl.sum(tl.where(has_p, P * (log_P - log_Q), 0.0), axis=1)
        g = tl.where(has_p, -P, 0.0)
        if MASS == 1:
            loss += P_t * (log_P_t - log_Q_t)
            g_t = -P_t
    elif KIND == 1:
        loss = tl.sum(tl.where(has_q, Q * (log_Q - log_P), 0.0), axis=1)
        g = tl.where(has_q, Q * (log_Q - log_P + 1.0), 0.0)
        if MASS == 1:
            loss += Q_t * (log_Q_t - log_P_t)
            g_t = Q_t * (log_Q_t - log_P_t + 1.0)
    else:
        beta = tl.full([], beta_arg, tl.float64)
        one_m_beta = one - beta
        log_beta = tl.full([], log_beta_arg, tl.float64)
        log1m_beta = tl.full([], log1m_beta_arg, tl.float64)
        # log M = logaddexp(log P + log b, log Q + log(1-b)) = hi + log1p(exp(lo - hi))
        a = log_P + log_beta
        b = log_Q + log1m_beta
        hi = tl.maximum(a, b)
        both_zero = hi == _NEG_INF
        u = tl.exp(tl.where(both_zero, _NEG_INF, tl.minimum(a, b) - hi))
        w = 1.0 + u
        l1p = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, one, w - 1.0)))
        log_M = tl.where(both_zero, _NEG_INF, hi + l1p)
        kl_pm = tl.sum(tl.where(has_p, P * (log_P - log_M), 0.0), axis=1)
        kl_qm = tl.sum(tl.where(has_q, Q * (log_Q - log_M), 0.0), axis=1)
        g = tl.where(has_q, one_m_beta * Q * (log_Q - log_M), 0.0)
        if MASS == 1:
            a_t = log_P_t + log_beta
            b_t = log_Q_t + log1m_beta
            hi_t = tl.maximum(a_t, b_t)
            u_t = tl.exp(tl.minimum(a_t, b_t) - hi_t)
            w_t = 1.0 + u_t
            l1p_t = tl.where(w_t == 1.0, u_t, tl.log(w_t) * (u_t / tl.where(w_t == 1.0, one, w_t - 1.0)))
            log_M_t = hi_t + l1p_t
            kl_pm += P_t * (log_P_t - log_M_t)
            kl_qm += Q_t * (log_Q_t - log_M_t)
            g_t = one_m_beta * Q_t * (log_Q_t - log_M_t)
        loss = beta * kl_pm + one_m_beta * kl_qm

    if COVERAGE:
        coverage = tl.full([], coverage_arg, tl.float64)
        loss = loss - coverage * log_mq
    loss = tl.where(nonempty, loss, 0.0)
    tl.store(loss_ptr + rows, loss.to(loss_ptr.dtype.element_ty), mask=row_ok)
    # the support masses (metrics): here they cost two stores, in torch ~10 launches over [N, K]
    tl.store(mp_ptr + rows, tl.exp(log_mp).to(mp_ptr.dtype.element_ty), mask=row_ok)
    tl.store(mq_ptr + rows, tl.where(nonempty, tl.exp(log_mq), 0.0).to(mq_ptr.dtype.element_ty), mask=row_ok)

    if NEED_GRAD:
        g_sum = tl.sum(g, axis=1)
        if MASS == 0:
            d_s = g - q_S * g_sum[:, None]
            d_lse = tl.zeros([BLOCK_N], dtype=tl.float64)
        elif MASS == 1:
            g_tail = g_t * h
            d_s = g + q_S * g_tail[:, None]
            d_lse = -g_sum - g_tail
        else:
            d_s = g
            d_lse = -g_sum
        if COVERAGE:
            d_s = d_s - coverage * q_S
            d_lse = d_lse + coverage
        d_s = tl.where(v, d_s, 0.0)
        d_lse = tl.where(nonempty, d_lse, 0.0)
        tl.store(ds_ptr + r2 * K + c2, d_s.to(ds_ptr.dtype.element_ty), mask=in_blk)
        tl.store(dlse_ptr + rows, d_lse.to(dlse_ptr.dtype.element_ty), mask=row_ok)


_KERNEL = lazy_jit(_kd_sparse_objective_kernel)

# float64 entries per program: rows of one block share a program (small K would otherwise leave
# most lanes idle), K = 256 runs one row per program with 2 warps (num_warps = entries / 128).
ENTRIES_PER_PROGRAM = 256


def sparse_objective(s_S: torch.Tensor, lse: torch.Tensor, log_p_S: torch.Tensor, valid: torch.Tensor,
                     kind: str, beta: float, mass: str, coverage_coef: float, need_grad: bool = True,
                     num_warps: int | None = None, entries_per_program: int | None = None):
    """(loss [N], dL/ds_S [N, K] or None, dL/dlse [N] or None, teacher mass on S [N], student mass
    on S [N]) in the dtype of `s_S`.

    The first three as `sparse_objective.sparse_objective_and_grads`, the masses as
    `fused_kd.support_masses` (0 on a row without valid entries); one launch, no host sync.
    `s_S`, `log_p_S` float `[N, K]`, `lse` float `[N]` (any strides), `valid` bool `[N, K]`.
    """
    if mass not in MASS_CODES:
        raise ValueError(f"mass: expected one of ('renorm', 'tail', 'raw'), got {mass!r}")
    kind = effective_divergence(kind, beta)
    kind_code = KIND_CODES.get(kind, 2)    # the torch version treats any other kind as JSD
    log_beta = log1m_beta = 0.0
    if kind_code == 2 and mass != "raw":
        log_beta, log1m_beta = math.log(beta), math.log1p(-beta)
    n_rows, k = s_S.shape
    loss = s_S.new_empty(n_rows)
    d_s = s_S.new_empty(n_rows, k) if need_grad else None
    d_lse = s_S.new_empty(n_rows) if need_grad else None
    teacher_mass, student_mass = s_S.new_empty(n_rows), s_S.new_empty(n_rows)
    if n_rows == 0:
        return loss, d_s, d_lse, teacher_mass, student_mass
    block_k = triton.next_power_of_2(max(k, 1))
    per_program = entries_per_program or (64 if interpreting() else ENTRIES_PER_PROGRAM)
    block_n = max(1, min(per_program // block_k, triton.next_power_of_2(n_rows)))
    if num_warps is None:
        num_warps = 1 if interpreting() else max(1, min(8, block_n * block_k // 128))
    valid_u8 = valid.view(torch.uint8)
    grid = (triton.cdiv(n_rows, block_n),)
    _KERNEL.get()[grid](
        s_S, lse, log_p_S, valid_u8, loss, d_s if need_grad else loss, d_lse if need_grad else loss,
        teacher_mass, student_mass, n_rows, k, s_S.stride(0), s_S.stride(1), lse.stride(0),
        log_p_S.stride(0), log_p_S.stride(1),
        valid_u8.stride(0), valid_u8.stride(1),
        float(beta), log_beta, log1m_beta, float(coverage_coef),
        KIND=kind_code, MASS=MASS_CODES[mass], COVERAGE=bool(coverage_coef), NEED_GRAD=need_grad,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return loss, d_s, d_lse, teacher_mass, student_mass
