"""Sequence-level objectives, aggregation and metrics against brute-force loops / exact expectations."""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.losses import (
    DenseTeacher,
    TopKTeacher,
    aggregate,
    kd_loss_with_stats,
    kd_metrics,
    policy_gradient_kd_loss,
    sampled_token_kl,
    seq_ids_from_cu_seqlens,
    teacher_confidence_scores,
    teacher_confidence_weights,
)


def packed_batch(seed=0):
    """5 rollouts of 2 prompts, interleaved and of unequal group sizes (3 and 2), packed in one row."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4, 6, 3, 5, 2])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    total = int(lengths.sum())
    loss_mask = (torch.rand(total, generator=gen) > 0.3).float()
    loss_mask[cu_seqlens[4]:] = 0  # rollout 4 has no response token at all
    per_token = torch.rand(total, generator=gen, dtype=torch.float64) * 3
    group_ids = torch.tensor([7, 3, 7, 3, 7])  # prompt ids need not be 0..G-1 nor adjacent
    return per_token, loss_mask, cu_seqlens, group_ids


def test_teacher_confidence_weights_any_layout():
    scores = torch.tensor([-0.5, -2.0, -0.1, -1.0, -3.0], dtype=torch.float64)
    group_ids = torch.tensor([7, 3, 7, 3, 7])
    alpha = 2.0
    weights = teacher_confidence_weights(scores, group_ids, alpha)
    for g in (3, 7):
        members = (group_ids == g).nonzero().flatten()
        expected = torch.softmax(alpha * scores[members], dim=0)
        torch.testing.assert_close(weights[members], expected)
    perm = torch.tensor([4, 2, 0, 3, 1])  # shuffling the batch shuffles the weights, nothing else
    shuffled = teacher_confidence_weights(scores[perm], group_ids[perm], alpha)
    torch.testing.assert_close(shuffled, weights[perm])
    uniform = teacher_confidence_weights(scores, group_ids, 0.0)
    expected_uniform = torch.tensor([1 / 3, 1 / 2, 1 / 3, 1 / 2, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(uniform, expected_uniform)
    assert not teacher_confidence_weights(scores.requires_grad_(), group_ids, alpha).requires_grad


def test_tcad_loss_from_scores_weights_and_aggregation():
    per_token, loss_mask, cu_seqlens, group_ids = packed_batch()
    teacher_token_logprobs = -per_token.flip(0)
    seq_ids = seq_ids_from_cu_seqlens(cu_seqlens)
    scores = teacher_confidence_scores(teacher_token_logprobs, loss_mask, seq_ids, num_seqs=5)
    weights = teacher_confidence_weights(scores, group_ids, alpha=1.5)
    loss = aggregate(per_token, loss_mask, seq_ids, "seq-mean-token-mean", seq_weights=weights,
                     global_num_seqs=2.0, num_seqs=5)
    expected, seq_means = 0.0, []
    for i in range(5):
        tokens = slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1]))
        m = loss_mask[tokens].bool()
        seq_means.append(per_token[tokens][m].mean() if m.any() else None)
        s_i = teacher_token_logprobs[tokens][m].mean() if m.any() else torch.tensor(0.0, dtype=torch.float64)
        assert scores[i].item() == pytest.approx(s_i.item())
    for i in range(5):
        if seq_means[i] is not None:
            expected += weights[i] * seq_means[i]
    assert loss.item() == pytest.approx((expected / 2).item())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_is_invariant_to_micro_batch_split(mode):
    per_token, loss_mask, cu_seqlens, _ = packed_batch(seed=1)
    seq_ids = seq_ids_from_cu_seqlens(cu_seqlens)
    full = aggregate(per_token, loss_mask, seq_ids, mode, num_seqs=5)
    # brute force
    bounds = zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    seqs = [per_token[a:b][loss_mask[a:b].bool()] for a, b in bounds]
    if mode == "token-mean":
        expected = torch.cat(seqs).mean()
    else:
        present = [s for s in seqs if s.numel()]
        expected = sum(s.mean() if mode == "seq-mean-token-mean" else s.sum() for s in present) / len(present)
    assert full.item() == pytest.approx(expected.item())
    # two micro-batches (sequences 0-1 and 2-4) with the global denominator sum to the full-batch loss
    cut = int(cu_seqlens[2])
    global_kw = dict(global_num_tokens=loss_mask.sum()) if mode == "token-mean" else dict(global_num_seqs=4)
    parts = [aggregate(per_token[:cut], loss_mask[:cut], seq_ids[:cut], mode, **global_kw),
             aggregate(per_token[cut:], loss_mask[cut:], seq_ids[cut:] - 2, mode, **global_kw)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())
    # without it, per-micro-batch normalisation changes the loss (the trap this guards against)
    local = [aggregate(per_token[:cut], loss_mask[:cut], seq_ids[:cut], mode),
             aggregate(per_token[cut:], loss_mask[cut:], seq_ids[cut:] - 2, mode)]
    assert (local[0] + local[1]).item() != pytest.approx(full.item())


def test_aggregate_rejects_bad_mode_and_shapes():
    per_token, loss_mask, cu_seqlens, _ = packed_batch()
    with pytest.raises(ValueError, match="^mode:"):
        aggregate(per_token, loss_mask, None, "sum")
    with pytest.raises(ValueError, match="^loss_mask:"):
        aggregate(per_token, loss_mask[:-1])
    with pytest.raises(ValueError, match="^seq_ids:"):
        aggregate(per_token, loss_mask, None, "seq-mean-token-sum")
    assert aggregate(per_token, torch.zeros_like(loss_mask)).item() == 0.0


def test_sampled_token_kl_estimators_are_unbiased_for_reverse_kl():
    gen = torch.Generator().manual_seed(0)
    log_q = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    log_p = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    exact = (log_q.exp() * (log_q - log_p)).sum()
    tokens = torch.multinomial(log_q.exp(), 200_000, replacement=True, generator=gen)
    k1 = sampled_token_kl(log_q[tokens], log_p[tokens], "k1")
    k3 = sampled_token_kl(log_q[tokens], log_p[tokens], "k3")
    assert (k3 >= 0).all() and (k1 < 0).any()
    assert k1.mean().item() == pytest.approx(exact.item(), abs=0.02)
    assert k3.mean().item() == pytest.approx(exact.item(), abs=0.02)
    d = log_p[tokens] - log_q[tokens]
    torch.testing.assert_close(k3, d.exp() - d - 1)
    with pytest.raises(ValueError, match="^estimator:"):
        sampled_token_kl(log_q, log_p, "k2")


def test_policy_gradient_k1_is_the_reverse_kl_gradient_in_expectation():
    gen = torch.Generator().manual_seed(1)
    student_logits = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_()
    log_p = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    log_q = torch.log_softmax(student_logits, 0)
    tokens = torch.multinomial(log_q.detach().exp(), 200_000, replacement=True, generator=gen)
    out = policy_gradient_kd_loss(log_q[tokens], log_q[tokens].detach(), log_p[tokens], estimator="k1")
    out.loss.mean().backward()
    q = log_q.detach().exp()
    kl = (q * (log_q.detach() - log_p)).sum()
    exact = q * (log_q.detach() - log_p - kl)
    torch.testing.assert_close(student_logits.grad, exact, atol=0.02, rtol=0)
    assert not out.clipped.any()
    torch.testing.assert_close(out.advantages, -(log_q[tokens] - log_p[tokens]).detach())


def test_policy_gradient_clip_task_advantages_and_k1_rejection():
    student = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-0.5, -1.0, -1.5], dtype=torch.float64)  # ratios e^0.5, 1, e^-0.5
    teacher = torch.tensor([1.0, -1.0, -3.0], dtype=torch.float64)
    task = torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64)
    out = policy_gradient_kd_loss(student, old, teacher, kl_coef=0.5, clip_ratio=0.2, task_advantages=task)
    advantages = -0.5 * (student.detach() - teacher) + task
    torch.testing.assert_close(out.advantages, advantages)
    ratio = (student.detach() - old).exp()
    expected = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    torch.testing.assert_close(out.loss, expected)
    out.loss.sum().backward()
    # token 0: A > 0, ratio > 1.2 and token 2: A < 0, ratio < 0.8 -> clipped, no gradient;
    # token 1: ratio 1 -> gradient -A
    assert out.clipped.tolist() == [True, False, True]
    assert student.grad[0].item() == 0.0 and student.grad[2].item() == 0.0
    assert student.grad[1].item() == pytest.approx(-advantages[1].item())
    with pytest.raises(ValueError, match="^estimator: 'k1' without policy_gradient"):
        policy_gradient_kd_loss(student, old, teacher, estimator="k1", policy_gradient=False)
    direct = policy_gradient_kd_loss(student, old, teacher, estimator="k3", policy_gradient=False)
    assert direct.loss.requires_grad and (direct.loss >= 0).all()
    with pytest.raises(ValueError, match="^teacher_logprobs:"):
        policy_gradient_kd_loss(student, old, teacher[:2])


def test_kd_metrics_from_stats():
    gen = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(5, 23, generator=gen), torch.randn(5, 23, generator=gen)
    ids = torch.log_softmax(teacher, -1).topk(4, dim=-1).indices
    topk = TopKTeacher(ids, torch.log_softmax(teacher, -1).gather(1, ids))
    loss, stats = kd_loss_with_stats(student, topk, support="teacher", mass="tail")
    mask = torch.tensor([1, 1, 0, 1, 0])
    metrics = kd_metrics(loss, mask, stats)
    sel = mask.bool()
    expected = {"kd/loss_mean": loss[sel].mean(), "kd/loss_max": loss[sel].max(),
                "kd/teacher_mass_on_support": stats.teacher_mass[sel].mean(),
                "kd/student_mass_on_support": stats.student_mass[sel].mean(),
                "kd/topk_overlap": stats.topk_overlap[sel].mean()}
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        assert isinstance(metrics[name], torch.Tensor) and metrics[name].dim() == 0
        assert metrics[name].item() == pytest.approx(value.item(), rel=1e-6), name
    dense_metrics = kd_metrics(loss, None, kd_loss_with_stats(student, DenseTeacher(teacher))[1])
    assert dense_metrics["kd/teacher_mass_on_support"].item() == 1.0
    assert "kd/topk_overlap" not in dense_metrics
    assert kd_metrics(loss, torch.zeros(5))["kd/loss_max"].item() == 0.0
