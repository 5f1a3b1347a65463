"""Fused LM head + KD (`linear_kd_loss`, chunked torch twin) vs the float64 brute force on materialised logits.

The oracle is `tests.losses_reference.reference_kd_loss` on `hidden @ weight.T` in float64 (the
contract: "materialise logits, call kd_loss"). Every objective of the logits kernels' case table,
values and gradients w.r.t. hidden states and weight, grad_output != 1, odd shapes (N, H, V_local
no multiple of any block; blocks of 4 x 16 and 3 x 8 so that every loop is ragged), float32 and
bfloat16, vocabulary padding, tied input/output weights, the logging stats, bad input, and TP=2
over gloo (the hidden-state gradient summed over ranks, as Megatron's TP region does).
The Triton tiles run the same cases (fewer) in tests/test_fused_linear_kd_triton.py.
"""
from __future__ import annotations

import pytest
import torch

from opkd_kernels import cpu_backend
from opkd_kernels.linear_kd_chunked import ChunkedLinearKd
from opkd_kernels.torch_backend import TorchKdBackend
from opkd_mcore.losses import (
    DenseTeacher,
    HiddenTeacher,
    TopKTeacher,
    linear_kd_loss,
    linear_kd_loss_with_stats,
)
from tests import kernels_cases as cases
from tests._dist import run_distributed
from tests.losses_reference import reference_kd_loss

N, H, HT, V = 9, 13, 11, 41


def make_inputs(seed: int, n: int = N, v: int = V, scale: float = 3.0):
    """float64 hidden states and weights whose logits have a spread of ~`scale`."""
    g = torch.Generator().manual_seed(seed)
    h, ht = torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(n, HT, generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64) * scale / H ** 0.5
    wt = torch.randn(v, HT, generator=g, dtype=torch.float64) * scale / HT ** 0.5
    return h, w, ht, wt


def masked(z: torch.Tensor, end: int | None) -> torch.Tensor:
    if end is None:
        return z
    return torch.cat([z[:, :end], torch.full_like(z[:, end:], -1.0e4)], dim=1)


def reference(h, w, teacher, weights, vocab_end=None, teacher_vocab_end=None, **kd):
    """float64 (loss, d/dh, d/dw) of sum(weights * loss) on materialised logits."""
    h64, w64 = h.detach().double().clone().requires_grad_(), w.detach().double().clone().requires_grad_()
    if isinstance(teacher, HiddenTeacher):
        teacher = DenseTeacher(masked(teacher.hidden.double() @ teacher.weight.double().T, teacher_vocab_end))
    loss = reference_kd_loss(masked(h64 @ w64.T, vocab_end), teacher, **kd)
    (loss * weights).sum().backward()
    return loss.detach(), h64.grad, w64.grad


def fused(h, w, teacher, weights, engine, tp_group=None, **kd):
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = linear_kd_loss(hh, ww, teacher, engine=engine, tp_group=tp_group, **kd)
    assert loss.dtype == torch.float32 and loss.shape == (h.shape[0],)
    (loss * weights.to(loss.dtype)).sum().backward()
    assert hh.grad.dtype == h.dtype and ww.grad.dtype == w.dtype
    return loss.detach(), hh.grad, ww.grad


# float32: float32 accumulation only; bfloat16: the same rounded inputs in float64, the gradients
# rounded to bfloat16 at the end (relative to the largest entry)
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-5, 1.6e-2)}


def assert_close_to_max(got, want, tol, what):
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-12,
                               msg=lambda m: f"{what}: {m}")


def assert_matches(h, w, teacher, engine, dtype=torch.float32, seed=0, tp_group=None, **kd):
    """Fused vs brute force on the same dtype-rounded inputs: loss, d/dh, d/dw."""
    h, w = h.to(dtype), w.to(dtype)
    if isinstance(teacher, HiddenTeacher):
        teacher = HiddenTeacher(teacher.hidden.to(dtype), teacher.weight.to(dtype))
    weights = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    ref = reference(h, w, teacher, weights, **kd)
    got = fused(h, w, teacher, weights, engine, **kd)
    loss_tol, grad_tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[0].double(), ref[0], atol=loss_tol, rtol=1e-4, msg=lambda m: f"loss {kd}: {m}")
    assert_close_to_max(got[1], ref[1], grad_tol, f"d/dhidden {kd}")
    assert_close_to_max(got[2], ref[2], grad_tol, f"d/dweight {kd}")
    return got


def engines():
    out = {"torch": ChunkedLinearKd(TorchKdBackend(), block_rows=3, block_cols=8)}
    if cpu_backend.available():
        out["cpp"] = ChunkedLinearKd(cpu_backend.CppKdBackend(), block_rows=4, block_cols=16)
    return out


ENGINES = engines()
_ids = lambda kd: "-".join(f"{k}={v}" for k, v in kd.items())


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kd", cases.DENSE_CASES, ids=_ids)
def test_dense_teacher_full_vocabulary(kd, dtype, engine):
    h, w, ht, wt = make_inputs(1)
    assert_matches(h, w, HiddenTeacher(ht, wt), ENGINES[engine], dtype=dtype, **kd)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("kd", cases.TOPK_CASES, ids=_ids)
def test_topk_teacher(kd, engine):
    h, w, ht, wt = make_inputs(2)
    loss, d_h, _ = assert_matches(h, w, cases.make_topk(ht @ wt.T, k=6), ENGINES[engine], support="teacher", **kd)
    assert loss[2].item() == 0.0 and d_h[2].abs().max().item() == 0.0   # all-padding row


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("kd", cases.DENSE_SUPPORT_CASES, ids=_ids)
def test_dense_teacher_on_sparse_support(kd, engine):
    h, w, ht, wt = make_inputs(3)
    assert_matches(h, w, HiddenTeacher(ht, wt), ENGINES[engine], **kd)


def test_bf16_topk_and_dense_support():
    h, w, ht, wt = make_inputs(4)
    engine = ChunkedLinearKd(TorchKdBackend(), block_rows=4, block_cols=16)
    assert_matches(h, w, cases.make_topk(ht @ wt.T, k=5), engine, dtype=torch.bfloat16, support="teacher",
                   divergence="jsd", beta=0.5, mass="tail", coverage_coef=0.2)
    assert_matches(h, w, HiddenTeacher(ht, wt), engine, dtype=torch.bfloat16, support="union", k=4,
                   divergence="reverse_kl", mass="renorm")


@pytest.mark.parametrize("kd", [dict(divergence="reverse_kl", temperature=1.3), dict(divergence="jsd", beta=0.4),
                                dict(support="union", k=3, divergence="forward_kl", mass="tail")], ids=_ids)
def test_vocabulary_padding_columns(kd):
    """Columns past the real vocabulary: logit -1e4 for student and teacher, no gradient to their rows."""
    h, w, ht, wt = make_inputs(5)
    engine = ChunkedLinearKd(TorchKdBackend(), block_rows=4, block_cols=16)
    _, _, d_w = assert_matches(h, w, HiddenTeacher(ht, wt), engine, vocab_end=V - 7, teacher_vocab_end=V - 9, **kd)
    assert d_w[V - 7:].abs().max().item() == 0.0


def test_topk_teacher_with_student_padding():
    h, w, ht, wt = make_inputs(6)
    u = ht @ wt.T
    u[:, V - 5:] = -1e9   # the teacher never lists a padding id
    engine = next(iter(ENGINES.values()))
    assert_matches(h, w, cases.make_topk(u, k=5), engine, support="teacher", mass="tail", vocab_end=V - 5)


def test_tied_input_and_output_weights():
    """One parameter as embedding and output layer: its gradient is the sum of both uses."""
    _, w, ht, wt = make_inputs(7)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))
    mix = torch.randn(H, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / H ** 0.5
    teacher = HiddenTeacher(ht.float(), wt.float())
    grads = []
    for materialise in (True, False):
        emb = torch.nn.Parameter(w.clone().float() if not materialise else w.clone())
        hidden = torch.tanh(emb[tokens] @ (mix if materialise else mix.float()))
        if materialise:
            loss = reference_kd_loss(hidden @ emb.T, DenseTeacher(ht @ wt.T), divergence="jsd", beta=0.3)
        else:
            loss = linear_kd_loss(hidden, emb, teacher, divergence="jsd", beta=0.3, engine=ENGINES["torch"])
        loss.sum().backward()
        grads.append(emb.grad)
    assert_close_to_max(grads[1], grads[0], 2e-5, "tied weight gradient")


def test_stats_lse_and_teacher_top1():
    h, w, ht, wt = make_inputs(8)
    _, stats = linear_kd_loss_with_stats(h.float(), w.float(), HiddenTeacher(ht.float(), wt.float()),
                                         temperature=2.0, engine=ENGINES["torch"])
    u = ht @ wt.T
    torch.testing.assert_close(stats.lse.double(), torch.stack([torch.logsumexp(h @ w.T / 2, 1),
                                                                torch.logsumexp(u / 2, 1)], 1), atol=1e-5, rtol=1e-6)
    assert torch.equal(stats.teacher_top1, u.argmax(1))
    assert torch.equal(stats.teacher_mass, torch.ones(N))
    _, topk_stats = linear_kd_loss_with_stats(h.float(), w.float(), cases.make_topk(u, 4), support="teacher",
                                              engine=ENGINES["torch"])
    assert (topk_stats.teacher_top1 == -1).all() and topk_stats.student_mass[2].item() == 0.0


def test_nan_teacher_hidden_gives_nan_lse_without_validation():
    h, w, ht, wt = make_inputs(9)
    ht = ht.clone()
    ht[3] = float("nan")
    _, stats = linear_kd_loss_with_stats(h.float(), w.float(), HiddenTeacher(ht.float(), wt.float()),
                                         validate=False, engine=ENGINES["torch"])
    assert torch.isnan(stats.lse[3, 1]) and not torch.isnan(stats.lse[:3, 1]).any()


@pytest.mark.parametrize("call, match", [
    (lambda h, w, t: linear_kd_loss(h, w[:, :5], t), "^weight: expected"),
    (lambda h, w, t: linear_kd_loss(h, w, HiddenTeacher(t.hidden[:4], t.weight)), "^teacher.hidden: expected"),
    (lambda h, w, t: linear_kd_loss(h, w, HiddenTeacher(t.hidden, t.weight[:5])), "^teacher.weight: expected"),
    (lambda h, w, t: linear_kd_loss(h, w, DenseTeacher(h @ w.T)), "^teacher: expected HiddenTeacher"),
    (lambda h, w, t: linear_kd_loss(h, w, t, support="teacher"), "^k: expected an int"),
    (lambda h, w, t: linear_kd_loss(h, w, t, mass="raw", divergence="jsd", support="teacher", k=2), "^mass:"),
    (lambda h, w, t: linear_kd_loss(h, w, t, impl="nope"), "^impl: expected one of"),
    (lambda h, w, t: linear_kd_loss(h.double(), w.double(), HiddenTeacher(t.hidden.double(), t.weight.double()),
                                    impl="fused"), "^impl: 'fused' was requested"),
    (lambda h, w, t: linear_kd_loss(h, w, HiddenTeacher(t.hidden * float("nan"), t.weight)), "^teacher.hidden: expected no NaN"),
    (lambda h, w, t: linear_kd_loss(h, w, TopKTeacher(torch.full((N, 2), V, dtype=torch.long), torch.zeros(N, 2)),
                                    support="teacher"), "^teacher.ids: expected ids in"),
])
def test_bad_input_is_a_value_error_naming_the_argument(call, match):
    h, w, ht, wt = make_inputs(10)
    with pytest.raises(ValueError, match=match):
        call(h.float(), w.float(), HiddenTeacher(ht.float(), wt.float()))


def test_float64_auto_takes_the_reference_path():
    h, w, ht, wt = make_inputs(11)
    loss, stats = linear_kd_loss_with_stats(h, w, HiddenTeacher(ht, wt), divergence="reverse_kl")
    assert stats is None and loss.dtype == torch.float64
    torch.testing.assert_close(loss, reference_kd_loss(h @ w.T, DenseTeacher(ht @ wt.T), divergence="reverse_kl"))


# ---------------------------------------------------------------- TP=2 over gloo
TP_CASES = [
    (dict(divergence="jsd", beta=0.3, temperature=1.5), "hidden"),
    (dict(divergence="reverse_kl", vocab_end=2 * V - 6, teacher_vocab_end=2 * V - 6), "hidden"),
    (dict(support="union", k=4, divergence="forward_kl", mass="tail", coverage_coef=0.3), "hidden"),
    (dict(support="teacher", divergence="forward_kl", mass="raw"), "topk"),
    (dict(support="teacher", divergence="jsd", beta=0.6, mass="renorm", coverage_coef=1.0), "topk"),
]


def tp_worker(rank, world, engine_name, env_cases):
    """Each rank: its vocabulary shard of W and W_t; the loss, sum_r d/dh and its dW rows vs TP=1."""
    import torch.distributed as dist

    from opkd_kernels.fused_linear_kd import select_linear_engine

    engine = (ChunkedLinearKd(TorchKdBackend(), block_rows=4, block_cols=16) if engine_name == "torch"
              else select_linear_engine(torch.empty(1), engine_name))
    out = []
    for kd, kind in env_cases:
        h, w, ht, wt = make_inputs(12, v=2 * V)
        teacher = HiddenTeacher(ht, wt) if kind == "hidden" else cases.make_topk(ht @ wt.T, k=7)
        weights = torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
        ref_loss, ref_dh, ref_dw = reference(h, w, teacher, weights, **kd)
        shard = slice(rank * V, (rank + 1) * V)
        local = HiddenTeacher(ht.float(), wt[shard].float()) if kind == "hidden" else teacher
        loss, d_h, d_w = fused(h.float(), w[shard].float(), local, weights, engine, tp_group=dist.group.WORLD, **kd)
        dist.all_reduce(d_h)   # Megatron's TP region: the hidden-state gradient summed over ranks
        torch.testing.assert_close(loss.double(), ref_loss, atol=2e-5, rtol=1e-4)
        assert_close_to_max(d_h, ref_dh, 2e-5, f"d/dhidden {kd}")
        assert_close_to_max(d_w, ref_dw[shard], 2e-5, f"d/dweight {kd}")
        out.append(loss.tolist())
    return out


def test_tp2_over_gloo_matches_the_full_vocabulary():
    name = "cpp" if cpu_backend.available() else "torch"
    per_rank = run_distributed(tp_worker, 2, name, TP_CASES)
    assert per_rank[0] == per_rank[1]   # the loss is bit-identical on every rank
