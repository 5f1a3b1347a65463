"""The four fused-KD primitives in plain torch, on one block of logits rows `[R, C]`.

The same contracts as `triton_backend.TritonKdBackend` and `cpu_backend.CppKdBackend` (formulas in
`kd_row_stats.py`, `kd_jsd_sums.py`, `kd_grad.py`, `kd_sparse_scatter.py`), for devices with neither
Triton nor the C++ twin (Ascend NPU) and for float64 blocks. Each call makes a few temporaries of
the block's size, so the caller bounds memory by the block it passes: the fused LM-head loss hands it
[rows, cols] blocks of logits (`linear_kd_chunked.py`), never a whole [N, V_local] shard.
Math in float32 (float64 for float64 blocks); statistics come back in that dtype.
"""
from __future__ import annotations

import math

import torch

# A row's running max never drops below this: exp(m - m') stays finite for an all-masked row.
_MAX_FLOOR = -1e30


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _log_mix(log_p, log_q, beta: float):
    """log(beta p + (1 - beta) q), computed in log space."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


class TorchKdBackend:
    """Row statistics, JSD sums, gradient and support scatter for a block of logits, in torch."""

    name = "torch"

    def row_stats(self, student, teacher, inv_t, want="ab"):   # computes both sums whatever `want`
        cd = _compute_dtype(student)
        s = student.to(cd) * inv_t
        m_s = s.amax(dim=1).clamp(min=_MAX_FLOOR)
        e_s = torch.exp(s - m_s[:, None])
        out = torch.zeros(s.shape[0], 6, dtype=cd, device=s.device)
        out[:, 0], out[:, 1] = m_s, e_s.sum(dim=1)
        if teacher is not None:
            u = teacher.to(cd) * inv_t
            m_u = u.amax(dim=1).clamp(min=_MAX_FLOOR)
            e_u = torch.exp(u - m_u[:, None])
            diff = u - s
            out[:, 2], out[:, 3] = m_u, e_u.sum(dim=1)
            # e == 0 guards 0 * inf where a logit is -inf
            out[:, 4] = torch.where(e_u > 0, e_u * diff, 0.0).sum(dim=1)
            out[:, 5] = torch.where(e_s > 0, -e_s * diff, 0.0).sum(dim=1)
        return out

    def jsd_sums(self, student, teacher, lse, inv_t, beta):
        cd = _compute_dtype(student)
        log_q = student.to(cd) * inv_t - lse[:, :1].to(cd)
        log_p = teacher.to(cd) * inv_t - lse[:, 1:2].to(cd)
        log_m = _log_mix(log_p, log_q, beta)
        q, p = torch.exp(log_q), torch.exp(log_p)
        q_term = torch.where(q > 0, q * (log_q - log_m), 0.0)
        p_term = torch.where(p > 0, p * (log_p - log_m), 0.0)
        return torch.stack([(beta * p_term + (1.0 - beta) * q_term).sum(dim=1), q_term.sum(dim=1)], dim=1)

    def write_grad(self, student, teacher, out, lse, coef, inv_t, beta, code):
        cd = _compute_dtype(student)
        log_q = student.to(cd) * inv_t - lse[:, :1].to(cd)
        q = torch.exp(log_q)
        c0, c1 = coef[:, :1].to(cd), coef[:, 1:2].to(cd)
        if code == 0:
            g = c0 * q
        else:
            log_p = teacher.to(cd) * inv_t - lse[:, 1:2].to(cd)
            if code == 1:
                g = c0 * (q - torch.exp(log_p))
            elif code == 2:
                g = torch.where(q > 0, c0 * q * (log_q - log_p - c1), 0.0)
            else:
                g = torch.where(q > 0, c0 * q * (log_q - _log_mix(log_p, log_q, beta) - c1), 0.0)
        out.copy_(g)   # `out` may be `student` itself: g was computed from it first
        return out

    def sparse_scatter(self, out, local_ids, s_support, d_support, lse, coef):
        if out.shape[0] == 0 or local_ids.shape[1] == 0:
            return out
        valid = (local_ids >= 0) & (local_ids < out.shape[1])
        idx = torch.where(valid, local_ids, 0)
        val = coef[:, :1] * torch.exp(s_support - lse[:, :1]) + d_support
        # Adding (new - current) at valid ids and 0 elsewhere: a masked write whose off-block
        # entries touch nothing, even when they share index 0 with a real id (no lost update).
        delta = torch.where(valid, val.to(out.dtype) - out.gather(1, idx), 0.0)
        out.scatter_add_(1, idx, delta.to(out.dtype))
        return out
