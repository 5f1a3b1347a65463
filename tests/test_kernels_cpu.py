"""The C++ twin (opkd_kernels._cpu) vs the float64 brute force: every objective, values and gradients.

Skipped when the optional extension was not built (then kd_loss runs the reference path anyway).
"""
from __future__ import annotations

import pytest
import torch

from opkd_kernels import cpu_backend
from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss
from opkd_mcore.losses.fused import fused_kd_loss_or_none
from tests import kernels_cases as cases
from tests._dist import run_distributed

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="opkd_kernels._cpu not built")

N, V = 9, 71


@pytest.mark.parametrize("kd", cases.DENSE_CASES, ids=lambda kd: "-".join(map(str, kd.values())))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_full_vocab(kd, dtype):
    z, t = cases.make_logits(N, V, seed=11)
    cases.assert_matches(z, DenseTeacher(t), "cpp", dtype=dtype, **kd)


@pytest.mark.parametrize("kd", cases.TOPK_CASES, ids=lambda kd: "-".join(map(str, kd.values())))
def test_topk_teacher(kd):
    z, t = cases.make_logits(N, 131, seed=12)
    cases.assert_matches(z, cases.make_topk(t, k=6), "cpp", support="teacher", **kd)


@pytest.mark.parametrize("kd", cases.DENSE_SUPPORT_CASES, ids=lambda kd: "-".join(map(str, kd.values())))
def test_dense_teacher_on_sparse_support(kd):
    z, t = cases.make_logits(N, 61, seed=13)
    cases.assert_matches(z, DenseTeacher(t), "cpp", **kd)


def test_long_rows_sum_accurately():
    # 20K entries per row: a plain float32 running sum would be off by ~1e-5 relative
    z, t = cases.make_logits(3, 20011, seed=14)
    cases.assert_matches(z, DenseTeacher(t), "cpp", divergence="forward_kl")
    cases.assert_matches(z, DenseTeacher(t), "cpp", divergence="jsd", beta=0.5)


def test_all_padding_row_and_extreme_logits():
    z, t = cases.make_logits(N, 53, seed=15, scale=40.0)
    tol = (5e-4, 1e-4)   # log-ratios of ~500 in float32
    loss, grad = cases.assert_matches(z, cases.make_topk(t, k=4), "cpp", support="teacher", mass="tail",
                                      divergence="reverse_kl", tol=tol)
    assert loss[2].item() == 0.0 and grad[2].abs().max().item() == 0.0
    cases.assert_matches(z, DenseTeacher(t), "cpp", divergence="reverse_kl", tol=tol)


def test_gradient_written_in_place_for_model_outputs():
    z, t = cases.make_logits(N, V, seed=16)
    leaf = z.float().requires_grad_()
    logits = leaf * 1.0
    seen = {}

    def record_grad_pointer(grad):
        seen["ptr"] = grad.data_ptr()

    logits.register_hook(record_grad_pointer)
    fused_kd_loss_or_none(logits, DenseTeacher(t.float()), backend="cpp", divergence="jsd").sum().backward()
    assert seen["ptr"] == logits.data_ptr()
    _, ref_grad = cases.reference(z, DenseTeacher(t), torch.ones(N, dtype=torch.float64), divergence="jsd")
    torch.testing.assert_close(leaf.grad.double(), ref_grad, atol=2e-6, rtol=1e-4)


def test_auto_dispatch_on_cpu_uses_the_twin_by_default():
    from opkd_kernels.fused_kd import LAUNCHES

    z, t = cases.make_logits(N, V, seed=17)
    assert fused_kd_loss_or_none(z, DenseTeacher(t)) is None          # float64: always the reference
    before = LAUNCHES["cpp"]
    auto = kd_loss(z.float(), DenseTeacher(t.float()))               # no environment variable needed
    assert LAUNCHES["cpp"] == before + 1
    fused = kd_loss(z.float(), DenseTeacher(t.float()), impl="cpp")
    reference = kd_loss(z.float(), DenseTeacher(t.float()), impl="reference")
    assert LAUNCHES["cpp"] == before + 2
    torch.testing.assert_close(auto, reference, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(fused, reference, atol=2e-5, rtol=1e-5)


def test_forced_backend_that_cannot_run_is_an_error():
    z, t = cases.make_logits(N, V, seed=17)
    with pytest.raises(ValueError, match="^impl: 'fused'"):
        kd_loss(z, DenseTeacher(t), impl="fused")                    # float64 has no fused kernel


def _tp2_worker(rank, world):
    import torch.distributed as dist

    z, t = cases.make_logits(N, 2 * 37, seed=18)
    v_local = z.shape[1] // world
    shard = slice(rank * v_local, (rank + 1) * v_local)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    out = []
    for kd, dense in [(dict(divergence="jsd", beta=0.3, temperature=1.4), True),
                      (dict(support="teacher", divergence="reverse_kl", mass="tail", coverage_coef=0.4), False),
                      (dict(support="union", k=3, divergence="forward_kl", mass="renorm"), True)]:
        teacher = DenseTeacher(t) if dense else cases.make_topk(t, k=5)
        ref_loss, ref_grad = cases.reference(z, teacher, weights, **kd)
        local = DenseTeacher(t[:, shard].float()) if dense else teacher
        loss, grad = cases.fused(z[:, shard].float(), local, weights, "cpp", tp_group=dist.group.WORLD, **kd)
        torch.testing.assert_close(loss.double(), ref_loss, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(grad.double(), ref_grad[:, shard], atol=2e-6, rtol=1e-4)
        out.append(loss.tolist())
    # fewer rows than ranks: rank 1 evaluates no rows of the sparse objective and still all-gathers
    top = cases.make_topk(t, k=5)
    one = TopKTeacher(top.ids[:1], top.logprobs[:1])
    kd = dict(support="teacher", divergence="jsd", beta=0.4, mass="tail")
    ref_loss, ref_grad = cases.reference(z[:1], one, weights[:1], **kd)
    loss, grad = cases.fused(z[:1, shard].float(), one, weights[:1], "cpp", tp_group=dist.group.WORLD, **kd)
    torch.testing.assert_close(loss.double(), ref_loss, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad.double(), ref_grad[:, shard], atol=2e-6, rtol=1e-4)
    # tp_group=None means TP=1 even inside a multi-process job: nothing is reduced over the world
    dense = DenseTeacher(t)
    ref_loss, ref_grad = cases.reference(z, dense, weights)
    loss, grad = cases.fused(z.float(), DenseTeacher(t.float()), weights, "cpp", tp_group=None)
    torch.testing.assert_close(loss.double(), ref_loss, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-6, rtol=1e-4)
    return out


def test_tp2_over_gloo_matches_full_vocabulary():
    per_rank = run_distributed(_tp2_worker, 2)
    assert per_rank[0] == per_rank[1]


@pytest.mark.parametrize("mass", ["renorm", "tail", "raw"])
def test_sparse_objective_in_row_chunks_equals_one_pass(monkeypatch, mass):
    """Row chunking (bounding the float64 temporaries) changes no value and no gradient."""
    from opkd_kernels import sparse_objective as so

    z, t = cases.make_logits(N, V, seed=21)
    top = cases.make_topk(t, k=6)
    s_S = z.gather(1, top.ids.clamp(min=0)).float()
    lse = torch.logsumexp(z, dim=1).float()
    valid = top.ids >= 0
    kind = "forward_kl" if mass == "raw" else "reverse_kl"
    args = (s_S, lse, top.logprobs.float(), valid, kind, 0.5, mass, 0.3)
    whole = so.sparse_objective_and_grads(*args)
    monkeypatch.setattr(so, "CHUNK_ENTRIES", 2 * s_S.shape[1])  # 2 rows per chunk, 5 chunks
    chunked = so.sparse_objective_and_grads(*args)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    loss_only = so.sparse_objective_and_grads(*args, need_grad=False)
    assert torch.equal(loss_only[0], whole[0]) and loss_only[1] is None
