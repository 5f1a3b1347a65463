"""kd_loss (reference path, one process) against the brute-force float64 reference in
tests/losses_reference.py: values and gradients for every divergence x support x mass x coverage,
plus the edge cases of the contract."""
from __future__ import annotations

import importlib
import types

import pytest
import torch

from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss, kd_loss_with_stats
from tests.losses_reference import reference_kd_loss

N, V, K = 7, 37, 6
DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0)]
SUPPORTS = [("dense", None), ("dense", "teacher"), ("topk", "teacher"), ("dense", "union")]


def kd_loss_ref(*args, **kwargs):
    """The reference path, whatever fused kernels exist (their own tests compare them to this)."""
    kwargs.setdefault("impl", "reference")
    return kd_loss(*args, **kwargs)


def make_inputs(seed=0, dtype=torch.float64, student_scale=2.0, teacher_scale=2.0):
    """Student/teacher logits [N, V] and a top-k teacher with the awkward rows of the contract:
    row 1 padded in the middle, row 2 all padding, row 3 holds ids 0 and V-1, row 4 a flat teacher
    (top-k mass far below 1), row 5 a very peaked teacher."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(N, V, generator=gen, dtype=torch.float64) * student_scale
    teacher = torch.randn(N, V, generator=gen, dtype=torch.float64) * teacher_scale
    teacher[4] *= 0.02
    teacher[5] *= 5.0
    log_p = torch.log_softmax(teacher, dim=-1)
    ids = log_p.topk(K, dim=-1).indices
    others = [i for i in log_p[3].argsort(descending=True).tolist() if i not in (0, V - 1)]
    ids[3] = torch.tensor([0, V - 1] + others[: K - 2])
    logprobs = log_p.gather(1, ids)
    ids[1, 2:4] = -1
    ids[2] = -1
    logprobs = torch.where(ids >= 0, logprobs, torch.tensor(float("-inf"), dtype=torch.float64))
    return student.to(dtype), teacher.to(dtype), TopKTeacher(ids, logprobs.to(dtype))


def grid():
    for teacher_kind, support in SUPPORTS:
        for divergence, beta in DIVERGENCES:
            if support is None:
                yield teacher_kind, support, divergence, beta, "renorm", 0.0
                continue
            for mass in ("renorm", "tail", "raw"):
                if mass == "raw" and divergence != "forward_kl":
                    continue
                for coverage in (0.0, 0.7):
                    yield teacher_kind, support, divergence, beta, mass, coverage


def run_both(student, teacher, kwargs, grad_weights):
    """(ours, reference) values and gradients w.r.t. the student logits."""
    ours_in = student.clone().requires_grad_()
    ref_in = student.clone().requires_grad_()
    ours = kd_loss(ours_in, teacher, impl="reference", **kwargs)
    (ours * grad_weights.to(ours.dtype)).sum().backward()
    ref = reference_kd_loss(ref_in, teacher, **kwargs)
    (ref * grad_weights.double()).sum().backward()
    return ours, ours_in.grad, ref, ref_in.grad


def pick_teacher(kind, dense_logits, topk):
    return DenseTeacher(dense_logits) if kind == "dense" else topk


@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("teacher_kind,support,divergence,beta,mass,coverage", list(grid()))
def test_matches_float64_reference(teacher_kind, support, divergence, beta, mass, coverage, temperature):
    student, dense, topk = make_inputs(seed=1)
    kwargs = dict(divergence=divergence, beta=beta, temperature=temperature, support=support,
                  k=None if support is None or teacher_kind == "topk" else 4, mass=mass,
                  coverage_coef=coverage)
    grad_weights = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)  # grad_output != 1, with signs
    ours, ours_grad, ref, ref_grad = run_both(student, pick_teacher(teacher_kind, dense, topk), kwargs,
                                              grad_weights)
    assert ours.dtype == torch.float64 and ours.shape == (N,)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-9, atol=1e-11)
    assert ref_grad.abs().sum() > 0


@pytest.mark.parametrize("teacher_kind,support,divergence,beta,mass,coverage",
                         [c for c in grid() if c[4] != "renorm" or c[5] == 0.7])
@pytest.mark.parametrize("scale", [80.0, 1e-4], ids=["peaked", "flat"])
def test_extreme_distributions_are_finite_and_exact(teacher_kind, support, divergence, beta, mass, coverage,
                                                    scale):
    student, dense, topk = make_inputs(seed=2, student_scale=scale, teacher_scale=scale)
    kwargs = dict(divergence=divergence, beta=beta, support=support, mass=mass, coverage_coef=coverage,
                  k=None if support is None or teacher_kind == "topk" else 3)
    teacher = pick_teacher(teacher_kind, dense, topk)
    ours, ours_grad, ref, ref_grad = run_both(student, teacher, kwargs, torch.ones(N, dtype=torch.float64))
    assert torch.isfinite(ours).all() and torch.isfinite(ours_grad).all()
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-7, atol=1e-9)
    for dtype in (torch.float32, torch.bfloat16):  # low precision: finite, no NaN/inf anywhere
        low = student.to(dtype).requires_grad_()
        teacher_low = (DenseTeacher(dense.to(dtype)) if teacher_kind == "dense"
                       else TopKTeacher(topk.ids, topk.logprobs.to(dtype)))
        loss = kd_loss(low, teacher_low, impl="reference", **kwargs)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(low.grad.float()).all()


@pytest.mark.parametrize("teacher_kind,support,divergence,beta,mass,coverage",
                         [c for c in grid() if c[5] == 0.7 or c[1] is None])
def test_bf16_inputs_fp32_math(teacher_kind, support, divergence, beta, mass, coverage):
    student, dense, topk = make_inputs(seed=3)
    student_bf16, dense_bf16 = student.bfloat16(), dense.bfloat16()
    topk_bf16 = TopKTeacher(topk.ids, topk.logprobs.bfloat16())
    kwargs = dict(divergence=divergence, beta=beta, temperature=1.3, support=support, mass=mass,
                  coverage_coef=coverage, k=None if support is None or teacher_kind == "topk" else 4)
    teacher = pick_teacher(teacher_kind, dense_bf16, topk_bf16)
    ours_in = student_bf16.clone().requires_grad_()
    ours = kd_loss(ours_in, teacher, impl="reference", **kwargs)
    ours.sum().backward()
    ref_in = student_bf16.double().requires_grad_()  # the reference sees the same rounded inputs
    ref_teacher = pick_teacher(teacher_kind, dense_bf16.double(),
                               TopKTeacher(topk.ids, topk_bf16.logprobs.double()))
    ref = reference_kd_loss(ref_in, ref_teacher, **kwargs)
    ref.sum().backward()
    assert ours.dtype == torch.float32 and ours_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("divergence,mass", [(d, m) for d in ("forward_kl", "reverse_kl", "jsd")
                                             for m in ("renorm", "tail", "raw")
                                             if m != "raw" or d == "forward_kl"])
def test_all_padding_rows_have_zero_loss_and_zero_gradient(divergence, mass):
    student, _, topk = make_inputs(seed=4)
    ids = topk.ids.clone()
    ids[[0, 6]] = -1
    logprobs = torch.where(ids >= 0, topk.logprobs, torch.tensor(float("-inf"), dtype=torch.float64))
    student.requires_grad_()
    loss = kd_loss_ref(student, TopKTeacher(ids, logprobs), divergence=divergence, support="teacher",
                       mass=mass,
                   coverage_coef=0.5, impl="reference")
    loss.sum().backward()
    for row in (0, 2, 6):
        assert loss[row].item() == 0.0
        assert torch.count_nonzero(student.grad[row]).item() == 0
    assert (loss[[3, 4]] != 0).all() and student.grad[3].abs().sum() > 0


def test_jsd_endpoints_are_unscaled_kl_with_a_jump():
    student, dense, _ = make_inputs(seed=5)
    teacher = DenseTeacher(dense)
    fkl = kd_loss_ref(student, teacher, divergence="forward_kl")
    rkl = kd_loss_ref(student, teacher, divergence="reverse_kl")
    torch.testing.assert_close(kd_loss_ref(student, teacher, divergence="jsd", beta=0.0), fkl)
    torch.testing.assert_close(kd_loss_ref(student, teacher, divergence="jsd", beta=1.0), rkl)
    near0 = kd_loss_ref(student, teacher, divergence="jsd", beta=1e-6)
    near1 = kd_loss_ref(student, teacher, divergence="jsd", beta=1 - 1e-6)
    assert (near0 < 1e-3 * fkl).all() and (near1 < 1e-3 * rkl).all()


def test_temperature_scales_dense_teacher_but_not_topk_teacher():
    student, dense, topk = make_inputs(seed=6)
    t = 2.5
    for kwargs in (dict(support="teacher", mass="tail"),
                   dict(support="teacher", mass="renorm", coverage_coef=1.0)):
        hot = kd_loss_ref(student, topk, temperature=t, **kwargs)
        torch.testing.assert_close(hot, kd_loss_ref(student / t, topk, **kwargs))
    hot_dense = kd_loss_ref(student, DenseTeacher(dense), temperature=t)
    torch.testing.assert_close(hot_dense, kd_loss_ref(student / t, DenseTeacher(dense / t)))
    # the gradient w.r.t. the raw logits carries the 1/T of the chain rule
    a, b = student.clone().requires_grad_(), (student / t).requires_grad_()
    kd_loss_ref(a, topk, temperature=t, support="teacher").sum().backward()
    kd_loss_ref(b, topk, support="teacher").sum().backward()
    torch.testing.assert_close(a.grad, b.grad / t)


def test_raw_mass_gradient_is_mp_q_minus_p_on_support():
    student, _, topk = make_inputs(seed=7)
    student.requires_grad_()
    loss = kd_loss_ref(student, topk, support="teacher", mass="raw")
    loss.sum().backward()
    q = torch.softmax(student.detach(), dim=-1)
    p_on_S = torch.zeros_like(q)
    for row in range(N):
        for tok, lp in zip(topk.ids[row].tolist(), topk.logprobs[row].tolist()):
            if tok >= 0:
                p_on_S[row, tok] = torch.tensor(lp, dtype=torch.float64).exp()
    m_p = p_on_S.sum(dim=-1, keepdim=True)
    expected = torch.where(m_p > 0, m_p * q - p_on_S, torch.zeros_like(q))
    torch.testing.assert_close(student.grad, expected)
    assert m_p[4].item() < 0.5  # the flat row's top-k keeps little mass and its raw loss can go negative


def test_renorm_plus_unit_coverage_is_teacher_renorm_with_full_student_softmax():
    """DistillKit / NeMo-RL top-k forward KL: sum_S P (log P - log q) with the full-vocab q."""
    student, _, topk = make_inputs(seed=8)
    loss = kd_loss_ref(student, topk, support="teacher", mass="renorm", coverage_coef=1.0)
    log_q = torch.log_softmax(student, dim=-1)
    valid = topk.ids >= 0
    log_P = topk.logprobs - torch.logsumexp(topk.logprobs, dim=-1, keepdim=True)
    terms = torch.where(valid, log_P.exp() * (log_P - log_q.gather(1, topk.ids.clamp(min=0))), 0.0)
    expected = torch.where(valid.any(-1), terms.sum(-1), 0.0)
    torch.testing.assert_close(loss, expected)


def test_output_dtypes_and_validate_switch():
    student, dense, topk = make_inputs(seed=9, dtype=torch.float32)
    for teacher, kwargs in ((DenseTeacher(dense), {}), (topk, dict(support="teacher", mass="tail"))):
        checked = kd_loss_ref(student, teacher, **kwargs)
        unchecked = kd_loss_ref(student, teacher, validate=False, **kwargs)
        assert checked.dtype == torch.float32 and checked.shape == (N,)
        assert torch.equal(checked, unchecked)


def test_topk_teacher_truncated_to_k():
    student, _, topk = make_inputs(seed=10)
    kwargs = dict(divergence="reverse_kl", support="teacher", mass="tail", k=3)
    ours = kd_loss_ref(student, topk, **kwargs)
    torch.testing.assert_close(ours, reference_kd_loss(student, topk, **kwargs))


def test_union_support_adds_student_topk():
    """Union with the student's own top-k differs from teacher-only support when they disagree."""
    student, dense, _ = make_inputs(seed=11)
    teacher = DenseTeacher(dense)
    loss_u, stats_u = kd_loss_with_stats(student, teacher, support="union", k=3, mass="renorm")
    loss_t, stats_t = kd_loss_with_stats(student, teacher, support="teacher", k=3, mass="renorm")
    assert (stats_u.student_mass >= stats_t.student_mass - 1e-12).all()
    assert (stats_u.student_mass > stats_t.student_mass + 1e-6).any()
    assert not torch.allclose(loss_u, loss_t)


def test_stats_masses_and_overlap():
    student, dense, topk = make_inputs(seed=12)
    _, stats = kd_loss_with_stats(student, topk, support="teacher", mass="tail")
    q = torch.softmax(student, dim=-1)
    valid = topk.ids >= 0
    expected_q = torch.where(valid, q.gather(1, topk.ids.clamp(min=0)), 0.0).sum(-1)
    expected_p = torch.where(valid, topk.logprobs.exp(), 0.0).sum(-1)
    torch.testing.assert_close(stats.student_mass, expected_q)
    torch.testing.assert_close(stats.teacher_mass, expected_p)
    student_top = student.topk(K, dim=-1).indices
    for row in range(N):
        teacher_ids = [i for i in topk.ids[row].tolist() if i >= 0]
        expected = len(set(teacher_ids) & set(student_top[row].tolist())) / max(len(teacher_ids), 1)
        assert stats.topk_overlap[row].item() == pytest.approx(expected)
    _, dense_stats = kd_loss_with_stats(student, DenseTeacher(student.clone()), overlap_k=5)
    assert torch.equal(dense_stats.topk_overlap, torch.ones(N, dtype=dense_stats.topk_overlap.dtype))


class FakeFusedModuleForDispatchTest(types.ModuleType):
    """Stands in for opkd_mcore.losses.fused (owned by the kernels part) to test the dispatch only."""

    def __init__(self, result):
        super().__init__("opkd_mcore.losses.fused")
        self.result, self.calls = result, []

    def fused_kd_loss_or_none(self, student_logits, teacher, **kwargs):
        self.calls.append(kwargs)
        if self.result is None or not kwargs.get("return_masses"):
            return self.result
        ones = torch.ones_like(self.result)
        return self.result, ones, ones, None


def test_dispatch_to_fused_and_fallback(monkeypatch):
    student, dense, _ = make_inputs(seed=13)
    sentinel = torch.full((N,), 42.0, dtype=torch.float64)
    fake = FakeFusedModuleForDispatchTest(sentinel)
    # the module, not the function of the same name that opkd_mcore.losses exports
    kd_loss_module = importlib.import_module("opkd_mcore.losses.kd_loss")
    monkeypatch.setattr(kd_loss_module, "fused_kd_loss_or_none", fake.fused_kd_loss_or_none)
    assert kd_loss(student, DenseTeacher(dense), divergence="jsd", beta=0.3) is sentinel
    call = fake.calls[-1]
    assert call["divergence"] == "jsd" and call["beta"] == 0.3 and "tp_group" in call
    reference = kd_loss(student, DenseTeacher(dense), impl="reference")
    assert not torch.equal(reference, sentinel) and len(fake.calls) == 1
    fake.result = None
    torch.testing.assert_close(kd_loss(student, DenseTeacher(dense)), reference)
    with pytest.raises(ValueError, match="^impl: 'fused'"):
        kd_loss(student, DenseTeacher(dense), impl="fused")


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_jsd_matches_the_gkd_trainer_formulation(beta):
    """GKD parity: TRL-style generalized JSD with F.kl_div (kl_div(input, target) = KL(target||input))."""
    student, dense, _ = make_inputs(seed=14)
    t = 1.5
    log_q = torch.log_softmax(student / t, dim=-1)
    log_p = torch.log_softmax(dense / t, dim=-1)
    kl_div = torch.nn.functional.kl_div
    if beta == 0.0:
        expected = kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    elif beta == 1.0:
        expected = kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    else:
        b = torch.tensor(beta, dtype=torch.float64)
        log_m = torch.logsumexp(torch.stack([log_q + torch.log(1 - b), log_p + torch.log(b)]), dim=0)
        expected = (b * kl_div(log_m, log_p, reduction="none", log_target=True)
                    + (1 - b) * kl_div(log_m, log_q, reduction="none", log_target=True)).sum(-1)
    ours = kd_loss(student, DenseTeacher(dense), divergence="jsd", beta=beta, temperature=t, impl="reference")
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
@pytest.mark.parametrize("support,mass", [(None, "renorm"), ("teacher", "tail"), ("union", "renorm")])
def test_vocab_padding_masked_to_minus_inf_is_ignored(divergence, beta, support, mass):
    """Entries set to -inf in both student and teacher (padded vocabulary) behave as if absent."""
    student, dense, _ = make_inputs(seed=15)
    pad = 5
    student_padded = torch.cat([student, torch.full((N, pad), float("-inf"), dtype=student.dtype)], dim=1)
    dense_padded = torch.cat([dense, torch.full((N, pad), float("-inf"), dtype=dense.dtype)], dim=1)
    kwargs = dict(divergence=divergence, beta=beta, support=support, mass=mass, coverage_coef=0.3,
                  k=None if support is None else 4)
    a, b = student.clone().requires_grad_(), student_padded.clone().requires_grad_()
    plain = kd_loss_ref(a, DenseTeacher(dense), **kwargs)
    padded = kd_loss_ref(b, DenseTeacher(dense_padded), **kwargs)
    plain.sum().backward()
    padded.sum().backward()
    torch.testing.assert_close(padded, plain)
    torch.testing.assert_close(b.grad[:, :V], a.grad)
    assert torch.count_nonzero(b.grad[:, V:]) == 0


@pytest.mark.parametrize("teacher_kind,support,mass", [("dense", None, "renorm"), ("topk", "teacher", "tail"),
                                                       ("dense", "union", "raw")])
def test_token_chunks_give_the_unchunked_result(teacher_kind, support, mass):
    student, dense, topk = make_inputs(seed=16)
    teacher = pick_teacher(teacher_kind, dense, topk)
    kwargs = dict(divergence="forward_kl", support=support, mass=mass, coverage_coef=0.2,
                  k=None if support is None or teacher_kind == "topk" else 3)
    a, b = student.clone().requires_grad_(), student.clone().requires_grad_()
    whole = kd_loss_ref(a, teacher, **kwargs)
    chunked = kd_loss_ref(b, teacher, token_chunk=3, **kwargs)  # 7 rows -> chunks of 3, 3, 1
    whole.sum().backward()
    chunked.sum().backward()
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(b.grad, a.grad)
    _, stats = kd_loss_with_stats(student, teacher, token_chunk=3, **kwargs)
    _, whole_stats = kd_loss_with_stats(student, teacher, **kwargs)
    torch.testing.assert_close(stats.student_mass, whole_stats.student_mass)
    with pytest.raises(ValueError, match="^token_chunk:"):
        kd_loss_ref(student, teacher, token_chunk=0, **kwargs)
