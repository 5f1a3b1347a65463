"""The peer table of docs/losses.md, re-derived: one test per row.

Each test holds a small float64 implementation of what the peer computes, written here from the
formula the peer's code implements (file and commit in docs/losses.md), and compares it with the
`kd_loss` / `policy_gradient_kd_loss` / sequence-level settings the table claims reproduce it:
values, and gradients (autograd of the peer's objective, or the peer's hand-written gradient
formula) where the claim covers them. Where a peer deviates (a clamp, a wrong gradient, a
different support), the test shows both sides: equal where the deviation is inactive, different
where it is active. The sparse-support peers (DistillKit, TCAD, tinker, MiniLLM) are in
`test_losses_peers_sparse.py`.
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
)

N, V, K = 6, 40, 8
F64 = torch.float64


def rand(seed: int, *shape, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


def served_topk(teacher_logits: torch.Tensor, k: int = K, temperature: float = 1.0):
    """A served teacher's top-k: ids [N, k] and their log-probabilities at `temperature` (m_p < 1)."""
    log_p = torch.log_softmax(teacher_logits / temperature, dim=-1)
    ids = log_p.topk(k, dim=-1).indices
    return ids, log_p.gather(1, ids)


def on_support(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values [N, K] scattered into [N, V] at ids (0 elsewhere)."""
    return torch.zeros(ids.shape[0], V, dtype=F64).scatter(1, ids, values)


def value_and_grad(fn, z: torch.Tensor, weights: torch.Tensor):
    """fn(z) and d/dz of sum(weights * fn(z)) (a random grad_output)."""
    z = z.detach().clone().requires_grad_(True)
    out = fn(z)
    (out * weights).sum().backward()
    return out.detach(), z.grad.detach()


def assert_same(peer, ours, z, weights, **tol):
    peer_v, peer_g = value_and_grad(peer, z, weights)
    ours_v, ours_g = value_and_grad(ours, z, weights)
    torch.testing.assert_close(ours_v, peer_v, **tol)
    torch.testing.assert_close(ours_g, peer_g, **tol)
    return ours_v, ours_g


def rowwise_max_abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs().reshape(x.shape[0], -1).amax(dim=-1)


# --------------------------------------------------------------------------------------------
# TRL GKDTrainer / DistillationTrainer: generalized JSD on dense logits
# --------------------------------------------------------------------------------------------

def trl_generalized_jsd(z, t, beta, temperature):
    log_q = torch.log_softmax(z / temperature, dim=-1)
    log_p = torch.log_softmax(t / temperature, dim=-1)
    if beta == 0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if beta == 1:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_q + math.log1p(-beta), log_p + math.log(beta)]), dim=0)
    return (beta * (log_p.exp() * (log_p - log_m)).sum(-1)
            + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1))


@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_trl_generalized_jsd(beta, temperature):
    z, t, w = rand(1, N, V), rand(2, N, V), rand(3, N, scale=1.0)
    assert_same(lambda x: trl_generalized_jsd(x, t, beta, temperature),
                lambda x: kd_loss(x, DenseTeacher(t), divergence="jsd", beta=beta, temperature=temperature),
                z, w)
    # reduction="batchmean" with labels: sum over the unmasked tokens / their number == token-mean
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    per_token = kd_loss(z, DenseTeacher(t), divergence="jsd", beta=beta, temperature=temperature)
    trl = trl_generalized_jsd(z, t, beta, temperature)[mask].sum() / mask.sum()
    torch.testing.assert_close(aggregate(per_token, mask, mode="token-mean"), trl)


# --------------------------------------------------------------------------------------------
# verl core OPD (verl/trainer/distillation): forward_kl_topk, clamped at 0
# --------------------------------------------------------------------------------------------

def test_verl_core_forward_kl_topk_clamp():
    """Same value and (correct) gradient as mass="raw" where the raw value is >= 0; verl's
    clamp_min(0) zeroes loss and gradient where it is negative, ours keeps both."""
    temperature = 1.7
    z, t, w = rand(10, N, V), rand(11, N, V), rand(12, N, scale=1.0)
    t[3:] *= 0.05                                   # flat teacher rows: top-k mass ~ K/V
    ids, lp = served_topk(t)                         # served logprobs: temperature not applied
    z[3:] = z[3:].scatter_add(1, ids[3:], torch.full((N - 3, K), 6.0, dtype=F64))  # student mass on S

    def verl_raw(x):                                # fsdp/losses.py (autograd) and megatron/losses.py
        log_q = torch.log_softmax(x / temperature, dim=-1).gather(1, ids)
        return (lp.exp() * (lp - log_q)).sum(-1)

    def ours(x):
        return kd_loss(x, TopKTeacher(ids, lp), support="teacher", mass="raw", temperature=temperature)

    ours_v, ours_g = assert_same(verl_raw, ours, z, w)
    # verl's Megatron backward, written out: d/d(z/T) = m_p q_j - p_j [j in S]; chain rule 1/T
    q = torch.softmax(z / temperature, dim=-1)
    p_s = on_support(ids, lp.exp())
    m_p = p_s.sum(-1, keepdim=True)
    torch.testing.assert_close(ours_g, w[:, None] * (m_p * q - p_s) / temperature)

    clamped_v, clamped_g = value_and_grad(lambda x: verl_raw(x).clamp_min(0.0), z, w)
    positive = ours_v >= 0
    assert positive[:3].all() and not positive[3:].any()       # both regimes are exercised
    torch.testing.assert_close(clamped_v[positive], ours_v[positive])
    torch.testing.assert_close(clamped_g[positive], ours_g[positive])
    assert (clamped_v[~positive] == 0).all() and (clamped_g[~positive] == 0).all()
    assert (ours_v[~positive] < -1e-3).all() and (rowwise_max_abs(ours_g[~positive]) > 1e-3).all()


# --------------------------------------------------------------------------------------------
# verl core OPD: sampled-token estimators (k1 as a policy-gradient reward, k3 as a direct loss)
# --------------------------------------------------------------------------------------------

def verl_kl_penalty(logprob, ref_logprob, mode):
    if mode == "k1":
        return logprob - ref_logprob
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(kl.exp() - kl - 1, min=-10, max=10)


def verl_vanilla_policy_loss(log_prob, old_log_prob, advantages, eps=0.2, clip_ratio_c=3.0):
    ratio = torch.exp(log_prob - old_log_prob)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - eps, 1 + eps)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-advantages * clip_ratio_c, clipped)
    return torch.where(advantages < 0, dual, clipped)


def test_verl_core_estimators():
    w = rand(20, 8, scale=1.0)
    # k1 + policy gradient: tokens 0-4 ordinary ratios; tokens 5-7 ratio 4 with k1 > 0 (A < 0):
    # verl's dual clip (c = 3) caps the loss there, our PPO-clip has no dual clip.
    old = -rand(21, 8, scale=1.0).abs() - 0.5
    log_ratio = torch.tensor([0.0, 0.05, -0.1, 0.15, -0.3, math.log(4.0), math.log(4.0), math.log(5.0)],
                             dtype=F64)
    new = old + log_ratio
    teacher = new - torch.tensor([0.3, -0.2, 0.5, -0.4, 0.1, 0.6, 0.2, 0.9], dtype=F64)   # k1 = new - teacher

    def verl_pg(x):
        advantages = -verl_kl_penalty(x.detach(), teacher, "k1")
        return verl_vanilla_policy_loss(x, old, advantages)

    def ours_pg(x):
        return policy_gradient_kd_loss(x, old, teacher, estimator="k1", kl_coef=1.0, clip_ratio=0.2).loss

    verl_v, verl_g = value_and_grad(verl_pg, new, w)
    ours_v, ours_g = value_and_grad(ours_pg, new, w)
    dual = torch.arange(8) >= 5
    torch.testing.assert_close(ours_v[~dual], verl_v[~dual])
    torch.testing.assert_close(ours_g[~dual], verl_g[~dual])
    assert ((ours_v[dual] - verl_v[dual]) > 0.1).all() and (verl_g[dual] == 0).all()

    # task rewards: verl adds the task PPO loss and coef * the distillation PPO loss (two clipped
    # losses); ours clips once with summed advantages. Equal unclipped (tokens 0-3), not token 4.
    coef = 0.7
    ratio_log = torch.tensor([0.0, 0.05, -0.1, 0.15, math.log(1.5)], dtype=F64)
    old5 = old[:5]
    new5 = old5 + ratio_log
    teacher5 = new5 - torch.tensor([0.3, -0.2, 0.5, -0.4, 0.4 / coef], dtype=F64)
    task = torch.tensor([0.5, -1.0, 0.2, 1.0, 1.0], dtype=F64)

    def verl_two_losses(x):
        distill = verl_vanilla_policy_loss(x, old5, -verl_kl_penalty(x.detach(), teacher5, "k1"))
        return verl_vanilla_policy_loss(x, old5, task) + coef * distill

    def ours_summed(x):
        return policy_gradient_kd_loss(x, old5, teacher5, kl_coef=coef, task_advantages=task).loss

    verl_v, verl_g = value_and_grad(verl_two_losses, new5, w[:5])
    ours_v, ours_g = value_and_grad(ours_summed, new5, w[:5])
    torch.testing.assert_close(ours_v[:4], verl_v[:4])
    torch.testing.assert_close(ours_g[:4], verl_g[:4])
    assert abs(ours_v[4] - verl_v[4]) > 0.05

    # k3 as a direct loss (verl's yaml default): equal while k3 <= 10; verl clamps at 10 (no gradient)
    delta = torch.tensor([0.3, -0.5, 1.0, -2.0, 2.0, 3.0, 4.0, 25.0], dtype=F64)   # log p - log q
    student = -rand(22, 8, scale=1.0).abs() - 1.0
    teacher = student + delta

    verl_v, verl_g = value_and_grad(lambda x: verl_kl_penalty(x, teacher, "k3"), student, w)
    ours_v, ours_g = value_and_grad(
        lambda x: policy_gradient_kd_loss(x, x.detach(), teacher, estimator="k3", policy_gradient=False).loss,
        student, w)
    clamped = ours_v > 10
    assert clamped.tolist() == [False] * 5 + [True] * 3
    torch.testing.assert_close(ours_v[~clamped], verl_v[~clamped])
    torch.testing.assert_close(ours_g[~clamped], verl_g[~clamped])
    assert (verl_v[clamped] == 10).all() and (verl_g[clamped] == 0).all()


# --------------------------------------------------------------------------------------------
# verl-recipe GKD (gkd/megatron/megatron_distill_losses.py): "kl", "rkl", "kl_rkl", "jsd"
# --------------------------------------------------------------------------------------------

def recipe_kl_value(z, ids, lp):
    q_s = torch.softmax(z, dim=-1).gather(1, ids)
    return (lp.exp() * (lp - torch.log(q_s + 1e-20))).sum(-1)


def recipe_kl_grad(z, ids, lp):
    """The recipe's backward: q_j - p_j [j in S] (d/dz, no temperature)."""
    return torch.softmax(z, dim=-1) - on_support(ids, lp.exp())


def recipe_rkl_value(z, ids, lp):
    eps = 1e-20
    q_s = torch.softmax(z, dim=-1).gather(1, ids)
    p_s = lp.exp()
    q_hat = q_s / (q_s.sum(-1, keepdim=True) + eps)
    p_hat = p_s / (p_s.sum(-1, keepdim=True) + eps)
    return (q_hat * (torch.log(q_hat + eps) - torch.log(p_hat + eps))).sum(-1)


def recipe_rkl_grad(z, ids, lp):
    """The recipe's backward: Q̂_j (a_j - Σ Q̂ a) on S, a = log Q̂ + 1 - log P̂; 0 off S."""
    q_s = torch.softmax(z, dim=-1).gather(1, ids)
    p_s = lp.exp()
    q_hat = q_s / q_s.sum(-1, keepdim=True)
    p_hat = p_s / p_s.sum(-1, keepdim=True)
    a = q_hat.log() + 1.0 - p_hat.log()
    return on_support(ids, q_hat * (a - (q_hat * a).sum(-1, keepdim=True)))


def recipe_jsd_value(z, ids, lp, beta):
    beta = min(max(beta, 1e-6), 1 - 1e-6)
    eps = 1e-20
    q = torch.softmax(z, dim=-1)
    q_s, p_s = q.gather(1, ids), lp.exp()
    m_s = beta * p_s + (1 - beta) * q_s
    kl_pm = (p_s * (lp - torch.log(m_s + eps))).sum(-1)
    kl_qm = (q_s * (torch.log(q_s + eps) - torch.log(m_s + eps))).sum(-1)
    rest = (1 - q_s.sum(-1)) * -math.log(1 - beta)
    return beta * kl_pm + (1 - beta) * (kl_qm + rest)


def recipe_jsd_grad(z, ids, lp, beta):
    """The recipe's backward: (1-β) q_j (A_j - KL(q‖M)), A_j = log(q_j/M_j) on S, -log(1-β) off S."""
    beta = min(max(beta, 1e-6), 1 - 1e-6)
    q = torch.softmax(z, dim=-1)
    q_s, p_s = q.gather(1, ids), lp.exp()
    m_s = beta * p_s + (1 - beta) * q_s
    a = torch.full_like(q, -math.log(1 - beta)).scatter(1, ids, q_s.log() - m_s.log())
    kl_qm = (q * a).sum(-1, keepdim=True)
    return (1 - beta) * q * (a - kl_qm)


def renormalised(lp):
    return lp - torch.logsumexp(lp, dim=-1, keepdim=True)


def test_verl_recipe_gkd_kl_gradient_is_wrong_when_topk_mass_below_one():
    z, t, w = rand(30, N, V), rand(31, N, V), rand(32, N, scale=1.0)
    ids, lp = served_topk(t)
    lp = torch.cat([lp[:3], renormalised(lp[3:])])          # rows 3-5: teacher top-k mass exactly 1
    m_p = lp.exp().sum(-1)
    assert (m_p[:3] < 0.99).all()
    # the value is mass="raw"; our gradient is the autograd gradient of that value
    true_v, true_g = assert_same(
        lambda x: recipe_kl_value(x, ids, lp),
        lambda x: kd_loss(x, TopKTeacher(ids, lp), support="teacher", mass="raw"), z, w)
    # the recipe's gradient: right when m_p = 1, wrong when m_p < 1
    recipe_g = w[:, None] * recipe_kl_grad(z, ids, lp)
    torch.testing.assert_close(recipe_g[3:], true_g[3:])
    assert (rowwise_max_abs(recipe_g[:3] - true_g[:3]) > 1e-3).all()
    # ... it is the gradient of value + (1 - m_p) * logsumexp(z)
    _, extra_g = value_and_grad(lambda x: recipe_kl_value(x, ids, lp) + (1 - m_p) * torch.logsumexp(x, -1),
                                z, w)
    torch.testing.assert_close(recipe_g, extra_g)
    # and it does not sum to 0 over the vocabulary (a function of softmax(z) has Σ_j ∂/∂z_j = 0)
    torch.testing.assert_close(recipe_kl_grad(z, ids, lp).sum(-1), 1 - m_p)


def test_verl_recipe_gkd_kl_shard_update_does_not_accumulate_id0():
    """TP > 1: off-shard ids go to local index 0 with p = 0, and `grad[row, idx] -= p` does not
    accumulate duplicates, so whether a real id 0 keeps its -p_0 depends on the order of S."""
    tp, rank = 2, 0
    v_local = V // tp
    z = rand(33, 1, V)
    q = torch.softmax(z, dim=-1)
    p0, p_off = 0.3, 0.2
    intended = q[:, :v_local].clone()
    intended[0, 0] -= p0                                      # the recipe's own formula, on this shard

    def recipe_shard_update(ids, probs):
        grad = q[:, :v_local].clone()
        on_shard = (ids >= rank * v_local) & (ids < (rank + 1) * v_local)
        local = torch.where(on_shard, ids - rank * v_local, torch.zeros_like(ids))
        grad[torch.arange(1)[:, None], local] -= probs * on_shard
        return grad

    def scatter_add_update(ids, probs):                       # what verl core does since 2026-03
        on_shard = (ids >= rank * v_local) & (ids < (rank + 1) * v_local)
        local = torch.where(on_shard, ids - rank * v_local, torch.zeros_like(ids))
        return q[:, :v_local].clone().scatter_add_(1, local, -(probs * on_shard))

    orders = [(torch.tensor([[0, V - 1]]), torch.tensor([[p0, p_off]], dtype=F64)),
              (torch.tensor([[V - 1, 0]]), torch.tensor([[p_off, p0]], dtype=F64))]
    for ids, probs in orders:
        torch.testing.assert_close(scatter_add_update(ids, probs), intended)
    results = [recipe_shard_update(ids, probs) for ids, probs in orders]
    assert not all(torch.allclose(r, intended) for r in results)
    for r in results:                                          # one of the two writes survives
        assert torch.isclose(r[0, 0], q[0, 0] - p0) or torch.isclose(r[0, 0], q[0, 0])


def test_verl_recipe_gkd_rkl_kl_rkl_jsd():
    z, t, w = rand(40, N, V), rand(41, N, V), rand(42, N, scale=1.0)
    ids, lp = served_topk(t)
    topk = TopKTeacher(ids, lp)

    # "rkl": renormalised reverse KL on the teacher's top-k; the recipe's backward is correct
    ours_v, ours_g = value_and_grad(
        lambda x: kd_loss(x, topk, divergence="reverse_kl", support="teacher", mass="renorm"), z, w)
    torch.testing.assert_close(ours_v, recipe_rkl_value(z, ids, lp))
    torch.testing.assert_close(ours_g, w[:, None] * recipe_rkl_grad(z, ids, lp))

    # "kl_rkl" (rkl_ratio r, default 0.1): (1-r) raw forward + r renorm reverse; the gradient of the
    # forward part carries the "kl" error
    r = 0.1

    def ours_mix(x):
        return ((1 - r) * kd_loss(x, topk, support="teacher", mass="raw")
                + r * kd_loss(x, topk, divergence="reverse_kl", support="teacher", mass="renorm"))

    true_v, true_g = assert_same(
        lambda x: (1 - r) * recipe_kl_value(x, ids, lp) + r * recipe_rkl_value(x, ids, lp), ours_mix, z, w)
    recipe_g = w[:, None] * ((1 - r) * recipe_kl_grad(z, ids, lp) + r * recipe_rkl_grad(z, ids, lp))
    assert (rowwise_max_abs(recipe_g - true_g) > 1e-3).all()

    # "jsd": the recipe's gradient is that of its value ...
    for beta in (0.3, 0.5):
        _, peer_g = value_and_grad(lambda x: recipe_jsd_value(x, ids, lp, beta), z, w)
        torch.testing.assert_close(w[:, None] * recipe_jsd_grad(z, ids, lp, beta), peer_g)
    # ... which is our tail JSD when the teacher's top-k holds all its mass (renormalised logprobs)
    full = TopKTeacher(ids, renormalised(lp))
    for beta in (0.3, 0.5):
        assert_same(lambda x: recipe_jsd_value(x, ids, full.logprobs, beta),
                    lambda x: kd_loss(x, full, divergence="jsd", beta=beta, support="teacher", mass="tail"),
                    z, w, atol=1e-9, rtol=1e-7)
        # with m_p < 1 the recipe drops the teacher's missing mass (a defective p), ours keeps it
        peer = recipe_jsd_value(z, ids, lp, beta)
        ours = kd_loss(z, topk, divergence="jsd", beta=beta, support="teacher", mass="tail")
        assert ((peer - ours).abs() > 1e-3).all()
    # beta is clamped into [1e-6, 1 - 1e-6]: beta = 1 gives ~0 instead of the reverse KL
    assert (recipe_jsd_value(z, ids, full.logprobs, 1.0).abs() < 1e-4).all()
    assert (kd_loss(z, full, divergence="jsd", beta=1.0, support="teacher", mass="tail") > 1e-2).all()


# --------------------------------------------------------------------------------------------
# NeMo-RL DistillationLossFn (forward / reverse / mixed, zero_outside_topk)
# --------------------------------------------------------------------------------------------

def nemo_rl_distillation(z, teacher_topk_logits, ids, kl_type, mixed_kl_weight, zero_outside_topk,
                         temperature):
    z = z / temperature
    log_t = torch.log_softmax(teacher_topk_logits / temperature, dim=-1)   # teacher renormalised on S
    if zero_outside_topk:
        log_q_full = torch.log_softmax(z, dim=-1)
        log_s = log_q_full.gather(1, ids)                                   # full-vocab student
        h_all = (log_q_full.exp() * log_q_full).sum(-1)
    else:
        log_s = torch.log_softmax(z.gather(1, ids), dim=-1)                # student renormalised on S
    s, p = log_s.exp(), log_t.exp()
    correction = torch.zeros(z.shape[0], dtype=F64)
    if zero_outside_topk and kl_type != "forward":
        correction = (h_all - (s * log_s).sum(-1)) - (-100.0) * (1 - s.sum(-1))
        if kl_type == "mixed":
            correction = correction * (1.0 - mixed_kl_weight)
    forward = p * (log_t - log_s)
    reverse = s * (log_s - log_t)
    per = {"forward": forward, "reverse": reverse,
           "mixed": mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse}[kl_type]
    return per.sum(-1) + correction


@pytest.mark.parametrize("temperature", [1.0, 1.5])
@pytest.mark.parametrize("kl_type,weight",
                         [("mixed", 0.5), ("mixed", 0.3), ("forward", 0.5), ("reverse", 0.5)])
@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_nemo_rl_distillation_loss(kl_type, weight, zero_outside_topk, temperature):
    z, t, w = rand(50, N, V), rand(51, N, V), rand(52, N, scale=1.0)
    ids, lp = served_topk(t, temperature=temperature)                 # teacher logprobs at T, m_p < 1
    topk = TopKTeacher(ids, lp)
    t_s = t.gather(1, ids)                                             # what NeMo-RL ships: top-k logits
    sparse = dict(support="teacher", mass="renorm", temperature=temperature)
    # reverse with zero_outside_topk: a teacher with log-prob -100 outside S, i.e. a densified teacher
    dense_logits = torch.full((N, V), -100.0, dtype=F64).scatter(1, ids, renormalised(lp)) * temperature
    densified = DenseTeacher(dense_logits)

    def forward(x):
        return kd_loss(x, topk, coverage_coef=1.0 if zero_outside_topk else 0.0, **sparse)

    def reverse(x):
        if zero_outside_topk:
            return kd_loss(x, densified, divergence="reverse_kl", temperature=temperature)
        return kd_loss(x, topk, divergence="reverse_kl", **sparse)

    ours = {"forward": forward, "reverse": reverse,
            "mixed": lambda x: weight * forward(x) + (1 - weight) * reverse(x)}[kl_type]
    assert_same(lambda x: nemo_rl_distillation(x, t_s, ids, kl_type, weight, zero_outside_topk, temperature),
                ours, z, w)

    if kl_type == "mixed" and not zero_outside_topk and weight == 0.5:
        # the default is not the renorm + coverage forward KL the old table claimed
        old_claim = kd_loss(z, topk, coverage_coef=1.0, **sparse)
        assert ((ours(z) - old_claim).abs() > 1e-3).all()
    if kl_type == "reverse" and zero_outside_topk:
        # no sparse setting reproduces it: e.g. the K+1-outcome reverse KL differs
        tail = kd_loss(z, TopKTeacher(ids, renormalised(lp)), divergence="reverse_kl", support="teacher",
                       mass="tail", temperature=temperature)
        assert ((ours(z) - tail).abs() > 1e-3).all()
