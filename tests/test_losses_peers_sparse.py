"""The peer table of docs/losses.md, second half: the sparse-support and sequence-level peers.

As in `test_losses_peers.py` (whose helpers this uses): a small float64 implementation of what
each peer computes, compared with the `kd_loss` / `policy_gradient_kd_loss` settings the table
claims reproduce it.
"""
from __future__ import annotations

import math

import pytest
import torch

from opkd_mcore.losses import (
    DenseTeacher,
    TopKTeacher,
    aggregate,
    kd_loss,
    policy_gradient_kd_loss,
    teacher_confidence_scores,
    teacher_confidence_weights,
)
from tests.test_losses_peers import (
    F64,
    N,
    V,
    assert_same,
    rand,
    renormalised,
    served_topk,
    value_and_grad,
)

# --------------------------------------------------------------------------------------------
# DistillKit sparse KL / JSD (missing-probability handling, temperature re-scaling, T^2)
# --------------------------------------------------------------------------------------------

def distillkit_target_logprobs(values, temperature, generation_temperature, missing):
    if math.isclose(temperature, generation_temperature) and missing == "symmetric_uniform":
        return values
    alpha = generation_temperature / temperature
    leftover = (1.0 - values.exp().sum(-1, keepdim=True)).clamp(0, 1)
    alpha_lse = torch.logsumexp(alpha * values, dim=-1, keepdim=True)
    if missing == "symmetric_uniform":
        final = torch.log(alpha_lse.exp() + leftover.pow(alpha))
    else:
        final = alpha_lse
    return alpha * values - final


def distillkit_student_logprobs(z, ids, temperature):
    logits = z if math.isclose(temperature, 1.0) else z * (1.0 / temperature)
    return logits.gather(1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def distillkit_sparse_kl(z, ids, values, temperature, generation_temperature, missing, eps=1e-8):
    """Per-token term of DistillKit's KLDLoss (the peer sums them, x T^2, / #tokens)."""
    log_s = distillkit_student_logprobs(z, ids, temperature)
    log_t = distillkit_target_logprobs(values, temperature, generation_temperature, missing)
    inner = (log_t.exp() * (log_t - log_s)).sum(-1)
    if missing == "symmetric_uniform":
        log_t_missing = torch.log1p(-log_t.exp().sum(-1).clamp(eps, 1 - eps))
        log_s_missing = torch.log1p(-log_s.exp().sum(-1).clamp(eps, 1 - eps))
        inner = inner + log_t_missing.exp() * (log_t_missing - log_s_missing)
    return inner * temperature ** 2


def distillkit_sparse_jsd(z, ids, values, missing, eps=1e-8):
    """Per-token term of DistillKit's JSDLoss at temperature 1 (beta fixed at 0.5)."""
    log_s = distillkit_student_logprobs(z, ids, 1.0)
    log_t = distillkit_target_logprobs(values, 1.0, 1.0, missing)
    s, p = log_s.exp(), log_t.exp()
    log_m = torch.log((0.5 * (p + s)).clamp(min=eps))
    kl_pm = torch.where(p > eps, p * (log_t - log_m), torch.zeros_like(p)).sum(-1)
    kl_qm = torch.where(s > eps, s * (log_s - log_m), torch.zeros_like(s)).sum(-1)
    if missing == "symmetric_uniform":
        log_tm = torch.log1p(-p.sum(-1).clamp(eps, 1 - eps))
        log_sm = torch.log1p(-s.sum(-1).clamp(eps, 1 - eps))
        log_mm = torch.log((0.5 * (log_tm.exp() + log_sm.exp())).clamp(min=eps))
        kl_pm = kl_pm + log_tm.exp() * (log_tm - log_mm)
        kl_qm = kl_qm + log_sm.exp() * (log_sm - log_mm)
    else:
        kl_qm = kl_qm + (1.0 - s.sum(-1)).clamp(min=0.0) * math.log(2.0)
    return 0.5 * (kl_pm + kl_qm)


@pytest.mark.parametrize("missing", ["zero", "symmetric_uniform"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distillkit_sparse_kl(missing, temperature):
    z, t, w = rand(60, N, V), rand(61, N, V), rand(62, N, scale=1.0)
    ids, values = served_topk(t)                    # logprobs generated at T_gen = 1, m_p < 1
    alpha = 1.0 / temperature                       # T_gen / T: DistillKit re-tempers the top-k
    if missing == "zero":
        # teacher p^alpha renormalised on S, student full softmax: renorm + unit coverage
        teacher = TopKTeacher(ids, alpha * values)
        kwargs = dict(mass="renorm", coverage_coef=1.0)
    else:
        # K+1 outcomes (p_S^alpha, (1 - m_p)^alpha) / Z: pass the tempered K+1 teacher, mass="tail"
        leftover = 1.0 - values.exp().sum(-1, keepdim=True)
        log_z = torch.log(torch.exp(alpha * values).sum(-1, keepdim=True) + leftover.pow(alpha))
        teacher = TopKTeacher(ids, alpha * values - log_z)
        kwargs = dict(mass="tail")
    assert_same(lambda x: distillkit_sparse_kl(x, ids, values, temperature, 1.0, missing),
                lambda x: kd_loss(x, teacher, support="teacher", temperature=temperature, **kwargs)
                * temperature ** 2,
                z, w)


@pytest.mark.parametrize("missing", ["zero", "symmetric_uniform"])
def test_distillkit_sparse_jsd(missing):
    z, t, w = rand(63, N, V), rand(64, N, V), rand(65, N, scale=1.0)
    ids, values = served_topk(t)
    # ZERO: the renormalised teacher has no tail (ours floors it at 1e-12); SYMMETRIC: K+1 outcomes
    teacher = TopKTeacher(ids, renormalised(values) if missing == "zero" else values)
    assert_same(lambda x: distillkit_sparse_jsd(x, ids, values, missing),
                lambda x: kd_loss(x, teacher, divergence="jsd", beta=0.5, support="teacher", mass="tail"),
                z, w, atol=1e-9, rtol=1e-7)


# --------------------------------------------------------------------------------------------
# TCAD (verl-recipe PR #51, gkd/fsdp/dp_actor.py): merged top-K support, coverage, confidence weights
# --------------------------------------------------------------------------------------------

def tcad_support(teacher_scaled, student_scaled, k):
    """First k distinct ids of t_1, s_1, t_2, s_2, ... (teacher and student top-k, interleaved)."""
    rows = []
    for t_ids, s_ids in zip(teacher_scaled.topk(k, dim=-1).indices.tolist(),
                            student_scaled.topk(k, dim=-1).indices.tolist()):
        merged, seen = [], set()
        for pair in zip(t_ids, s_ids):
            for idx in pair:
                if idx not in seen and len(merged) < k:
                    merged.append(idx)
                    seen.add(idx)
        rows.append(merged)
    return torch.tensor(rows)


def tcad_token_loss(z, t, kd_loss_type, jsd_alpha, coverage_coef, temperature, k):
    zs, ts = z / temperature, t / temperature
    support = tcad_support(ts.detach(), zs.detach(), k)
    t_sel, s_sel = ts.gather(1, support), zs.gather(1, support)
    s_logz = torch.logsumexp(s_sel, dim=-1, keepdim=True)
    log_t, log_s = t_sel - torch.logsumexp(t_sel, dim=-1, keepdim=True), s_sel - s_logz
    p, q = log_t.exp(), log_s.exp()
    m = jsd_alpha * p + (1 - jsd_alpha) * q
    log_m = torch.log(m + 1e-12)
    loss = {"forward_kl": (p * (log_t - log_s)).sum(-1),
            "reverse_kl": (q * (log_s - log_t)).sum(-1),
            "jsd": (jsd_alpha * (p * (log_t - log_m)).sum(-1)
                    + (1 - jsd_alpha) * (q * (log_s - log_m)).sum(-1)),
            }[kd_loss_type]
    coverage = torch.logsumexp(zs, dim=-1) - s_logz.squeeze(-1)
    return loss + coverage_coef * coverage


def disjoint_halves(seed, k):
    """Teacher and student logits whose top-(k/2) sets are disjoint (TCAD's S = our union)."""
    t, z = rand(seed, N, V, scale=1.0), rand(seed + 1, N, V, scale=1.0)
    for row in range(N):
        perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed + 10 + row))
        t[row, perm[: k // 2]] += 10.0
        z[row, perm[k // 2: k]] += 10.0
    return z, t


@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("kd_loss_type,alpha",
                         [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)])
@pytest.mark.parametrize("coverage_coef", [1.0, 0.3])
def test_tcad_token_loss(kd_loss_type, alpha, coverage_coef, temperature):
    k = 6
    w = rand(72, N, scale=1.0)
    def ours_for(t):
        return lambda x: kd_loss(x, DenseTeacher(t), divergence=kd_loss_type, beta=alpha, support="union",
                                 k=k // 2, mass="renorm", coverage_coef=coverage_coef,
                                 temperature=temperature)

    z, t = disjoint_halves(70, k)
    assert_same(lambda x: tcad_token_loss(x, t, kd_loss_type, alpha, coverage_coef, temperature, k),
                ours_for(t), z, w)

    # overlapping top-(k/2) sets: TCAD fills k ids by going deeper into both lists, our union is smaller
    t2 = rand(73, N, V)
    z2 = t2 + rand(74, N, V, scale=0.3)
    overlap = [len(set(a) & set(b)) > 0 for a, b in zip((t2 / temperature).topk(k // 2).indices.tolist(),
                                                        (z2 / temperature).topk(k // 2).indices.tolist())]
    assert all(overlap)
    peer = tcad_token_loss(z2, t2, kd_loss_type, alpha, coverage_coef, temperature, k)
    assert ((peer - ours_for(t2)(z2)).abs() > 1e-6).all()


def test_tcad_jsd_endpoints_are_not_special_cased():
    """TCAD's jsd at alpha = 0 is KL(Q‖Q) = 0; our beta = 0 is the unscaled forward KL."""
    k = 6
    z, t = disjoint_halves(75, k)
    peer = tcad_token_loss(z, t, "jsd", 0.0, 0.0, 1.0, k)
    ours = kd_loss(z, DenseTeacher(t), divergence="jsd", beta=0.0, support="union", k=k // 2, mass="renorm")
    fwd = kd_loss(z, DenseTeacher(t), divergence="forward_kl", support="union", k=k // 2, mass="renorm")
    assert (peer.abs() < 1e-9).all()
    torch.testing.assert_close(ours, fwd)
    assert (ours > 1e-2).all()


def test_tcad_sequence_weighting():
    """TCAD: per micro-batch (= the n rollouts of one prompt) sum_i w_i mean_t l_it with
    w = softmax(alpha * mean_t log p_T), divided by the number of micro-batches (gradient
    accumulation). Ours: the same scalar from any packed layout."""
    n, prompts, power_alpha = 3, 2, 1.3
    lengths = [4, 2, 5, 3, 3, 1]                        # rollout b*n + i = prompt b, rollout i
    gen = torch.Generator().manual_seed(80)
    per_tok = [torch.rand(length, generator=gen, dtype=F64) for length in lengths]
    teacher_lp = [-torch.rand(length, generator=gen, dtype=F64) * 3 for length in lengths]

    def tcad(per_tok):
        total = 0.0
        for b in range(prompts):
            idx = range(b * n, (b + 1) * n)
            score = torch.stack([teacher_lp[i].mean() for i in idx])
            s = power_alpha * score
            weights = torch.softmax(s - s.mean(), dim=0)
            weights = weights / weights.sum().clamp(min=1)
            loss_i = torch.stack([per_tok[i].sum() / max(lengths[i], 1) for i in idx])
            total = total + (weights * loss_i).sum() / prompts
        return total

    # ours: rollouts packed interleaved across prompts, plus a masked-out prompt token per rollout
    order = [0, 3, 1, 4, 2, 5]
    group_of = [i // n for i in range(n * prompts)]
    pieces_tok, pieces_lp, pieces_mask, pieces_seq = [], [], [], []
    for seq, rollout in enumerate(order):
        length = lengths[rollout]
        pieces_tok.append(torch.cat([torch.tensor([7.0], dtype=F64), per_tok[rollout]]))
        pieces_lp.append(torch.cat([torch.tensor([-50.0], dtype=F64), teacher_lp[rollout]]))
        pieces_mask.append(torch.tensor([False] + [True] * length))
        pieces_seq.append(torch.full((length + 1,), seq))
    packed = torch.cat(pieces_tok).requires_grad_(True)
    mask, seq_ids = torch.cat(pieces_mask), torch.cat(pieces_seq)
    scores = teacher_confidence_scores(torch.cat(pieces_lp), mask, seq_ids, len(order))
    weights = teacher_confidence_weights(scores, torch.tensor([group_of[r] for r in order]), power_alpha)
    ours = aggregate(packed, mask, seq_ids, "seq-mean-token-mean", seq_weights=weights,
                     global_num_seqs=prompts, num_seqs=len(order))

    leaves = [x.clone().requires_grad_(True) for x in per_tok]
    peer = tcad(leaves)
    torch.testing.assert_close(ours, peer)
    ours.backward()
    peer.backward()
    grads = packed.grad.split([length + 1 for length in (lengths[r] for r in order)])
    for seq, rollout in enumerate(order):
        assert grads[seq][0] == 0
        torch.testing.assert_close(grads[seq][1:], leaves[rollout].grad)


# --------------------------------------------------------------------------------------------
# Thinking Machines on-policy distillation (tinker-cookbook): reverse-KL reward, importance sampling
# --------------------------------------------------------------------------------------------

def test_tinker_on_policy_distillation():
    steps = 10
    w = rand(90, steps, scale=1.0)
    sampler = -rand(91, steps, scale=1.0).abs() - 0.3
    teacher = -rand(92, steps, scale=1.0).abs() - 0.3
    task = rand(93, steps, scale=0.5)
    coef = 1.0

    def tinker(x):                              # importance_sampling: -(exp(lp_new - lp_sampler) * A)
        advantages = task - coef * (sampler - teacher)          # incorporate_kl_penalty, no discount
        return -(torch.exp(x - sampler) * advantages)

    # exact, whatever the learner/sampler mismatch: advantages precomputed, clip disabled
    def ours_exact(x):
        return policy_gradient_kd_loss(x, sampler, teacher, kl_coef=0.0,
                                       task_advantages=task - coef * (sampler - teacher),
                                       clip_ratio=1.0, clip_ratio_high=float("inf")).loss

    learner = sampler + rand(94, steps, scale=0.4)
    assert_same(tinker, ours_exact, learner, w)

    # the usual call: equal on-policy (learner logprobs = sampler logprobs) ...
    def ours_usual(x):
        return policy_gradient_kd_loss(x, sampler, teacher, estimator="k1", kl_coef=coef,
                                       task_advantages=task).loss

    assert_same(tinker, ours_usual, sampler.clone(), w)
    # ... but not off-policy: our k1 uses the learner's log q and our PPO clip is 0.2
    peer_v, _ = value_and_grad(tinker, learner, w)
    ours_v, _ = value_and_grad(ours_usual, learner, w)
    assert (peer_v - ours_v).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------
# MiniLLM (microsoft/LMOps): the single-step reverse-KL term and the KD baseline's soft cross-entropy
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 1.4])
def test_minillm_single_step_and_soft_ce(temperature):
    z, t, w = rand(100, N, V), rand(101, N, V), rand(102, N, scale=1.0)

    def single_step(x):                          # _reg_loss: cross-entropy(q, p) - entropy(q)
        q = torch.softmax(x / temperature, dim=-1)
        xent = -(q * torch.log_softmax(t / temperature, dim=-1)).sum(-1)
        ent = -(q * torch.log_softmax(x / temperature, dim=-1)).sum(-1)
        return xent - ent

    assert_same(single_step,
                lambda x: kd_loss(x, DenseTeacher(t), divergence="reverse_kl", temperature=temperature), z, w)

    # pt_loss with kd_ratio: soft cross-entropy -sum p log q (T = 1) = forward KL + H(p): same gradient
    log_p = torch.log_softmax(t, dim=-1)
    entropy_p = -(log_p.exp() * log_p).sum(-1)
    assert_same(lambda x: -(log_p.exp() * torch.log_softmax(x, dim=-1)).sum(-1),
                lambda x: kd_loss(x, DenseTeacher(t), divergence="forward_kl") + entropy_p, z, w)
