"""The "rows" engine of the fused LM head (`linear_kd_loss_weighted`): gradients computed in the forward.

Oracle: the float64 materialised logits (`tests.test_fused_linear_kd.reference`: `hidden @ weight.T`,
`reference_kd_loss`, autograd of sum(c * loss)). Covered: every objective of the other engines' case
table (dense full vocabulary in float32 and bfloat16, top-k rows, dense teacher on a sparse
support), chunk sizes 1 .. > N over odd shapes (N = 9, H = 13, V_local = 41), the C++ and torch
logits backends, grad_output != 1, vocabulary padding, tied weights, no gradient to the teacher,
the logging stats, bad `row_weights`, the dW accumulation's precision in bfloat16, the weights of
`aggregate` for every mode, and TP=2 over gloo.
"""
from __future__ import annotations

import pytest
import torch

from opkd_kernels import cpu_backend
from opkd_kernels.linear_kd_rows import CHUNK_BYTES, chunk_rows_for, rows_linear_kd_loss
from opkd_mcore.losses import (
    AGG_MODES,
    DenseTeacher,
    HiddenTeacher,
    aggregate,
    aggregate_row_weights,
    linear_kd_loss_weighted,
)
from tests import kernels_cases as cases
from tests._dist import run_distributed
from tests.losses_reference import reference_kd_loss
from tests.test_fused_linear_kd import TOLERANCE, N, V, assert_close_to_max, make_inputs, masked, reference

BACKENDS = ["cpp", "torch"] if cpu_backend.available() else ["torch"]
_ids = lambda kd: "-".join(f"{k}={v}" for k, v in kd.items())


def rows(h, w, teacher, weights, impl, grad_scale=1.0, **kd):
    """(scalar, loss, d/dh, d/dw, stats) of the rows engine on leaf copies of h and w."""
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    scalar, loss, stats = linear_kd_loss_weighted(hh, ww, teacher, weights.to(torch.float32), impl=impl, **kd)
    assert scalar.dim() == 0 and not loss.requires_grad and loss.shape == (h.shape[0],)
    (scalar * grad_scale).backward()
    assert hh.grad.dtype == h.dtype and ww.grad.dtype == w.dtype
    return scalar.detach(), loss, hh.grad / grad_scale, ww.grad / grad_scale, stats


def reference_on(h, w, teacher, weights, logits_dtype, vocab_end=None, teacher_vocab_end=None, **kd):
    """`reference` with the logits rounded to `logits_dtype` first (the rows engine keeps them in the
    operands' dtype, as materialised logits are); the rounding passes gradients through unchanged."""
    h64, w64 = h.detach().double().clone().requires_grad_(), w.detach().double().clone().requires_grad_()
    if isinstance(teacher, HiddenTeacher):
        u = masked((teacher.hidden.double() @ teacher.weight.double().T).to(logits_dtype).double(), teacher_vocab_end)
        teacher = DenseTeacher(u)
    loss = reference_kd_loss(masked((h64 @ w64.T).to(logits_dtype).double(), vocab_end), teacher, **kd)
    (loss * weights).sum().backward()
    return loss.detach(), h64.grad, w64.grad


def assert_rows_match(h, w, teacher, impl, dtype=torch.float32, seed=0, chunk_rows=None, **kd):
    """Rows engine vs the float64 materialised logits on the same dtype-rounded inputs (bfloat16:
    also vs the logits rounded to bfloat16, with the float32 tolerances of the gradient's rounding)."""
    h, w = h.to(dtype), w.to(dtype)
    if isinstance(teacher, HiddenTeacher):
        teacher = HiddenTeacher(teacher.hidden.to(dtype), teacher.weight.to(dtype))
    weights = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    weights = weights.float().double()   # the engine takes float32 weights: the oracle the same ones
    ref_loss, ref_dh, ref_dw = reference(h, w, teacher, weights, **kd)
    scalar, loss, d_h, d_w, _ = rows(h, w, teacher, weights, impl, grad_scale=0.7, chunk_rows=chunk_rows, **kd)
    loss_tol, grad_tol = TOLERANCE[dtype]
    if dtype == torch.bfloat16:   # bf16 logits: ~3e-3 relative on the loss, ~1% on the gradients
        for got, want, what in ((loss, ref_loss, "loss"), (d_h, ref_dh, "d/dhidden"), (d_w, ref_dw, "d/dweight")):
            assert_close_to_max(got, want, 3e-2, f"{what} (bf16 logits vs exact) {kd}")
        ref_loss, ref_dh, ref_dw = reference_on(h, w, teacher, weights, dtype, **kd)
    torch.testing.assert_close(loss.double(), ref_loss, atol=loss_tol, rtol=1e-4, msg=lambda m: f"loss {kd}: {m}")
    torch.testing.assert_close(scalar.double(), (weights * ref_loss).sum(), atol=loss_tol * N, rtol=1e-4)
    assert_close_to_max(d_h, ref_dh, grad_tol, f"d/dhidden {kd}")
    assert_close_to_max(d_w, ref_dw, grad_tol, f"d/dweight {kd}")
    return loss, d_h, d_w


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kd", cases.DENSE_CASES, ids=_ids)
def test_dense_teacher_full_vocabulary(kd, dtype, impl):
    h, w, ht, wt = make_inputs(1)
    assert_rows_match(h, w, HiddenTeacher(ht, wt), impl, dtype=dtype, chunk_rows=4, **kd)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("kd", cases.TOPK_CASES, ids=_ids)
def test_topk_teacher(kd, impl):
    h, w, ht, wt = make_inputs(2)
    loss, d_h, _ = assert_rows_match(h, w, cases.make_topk(ht @ wt.T, k=6), impl, support="teacher", chunk_rows=2,
                                     **kd)
    assert loss[2].item() == 0.0 and d_h[2].abs().max().item() == 0.0   # all-padding row


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("kd", cases.DENSE_SUPPORT_CASES, ids=_ids)
def test_dense_teacher_on_sparse_support(kd, impl):
    h, w, ht, wt = make_inputs(3)
    assert_rows_match(h, w, HiddenTeacher(ht, wt), impl, chunk_rows=5, **kd)


@pytest.mark.parametrize("chunk_rows", [1, 2, 8, 9, 64, None])
def test_chunk_sizes_give_the_same_result(chunk_rows):
    """R = 1, ragged (2, 8), exactly N, larger than N, and the default (one chunk on CPU here)."""
    h, w, ht, wt = make_inputs(4)
    assert_rows_match(h, w, HiddenTeacher(ht, wt), BACKENDS[0], chunk_rows=chunk_rows, divergence="jsd", beta=0.4,
                      temperature=1.3)
    assert_rows_match(h, w, cases.make_topk(ht @ wt.T, k=5), BACKENDS[0], dtype=torch.bfloat16, support="teacher",
                      mass="tail", coverage_coef=0.2, chunk_rows=chunk_rows)


def test_default_chunk_rows_from_the_memory_budget():
    assert chunk_rows_for(16384, 151936, 2, True, "gpu") == 2048      # z and u: 1.16 GiB
    assert chunk_rows_for(16384, 151936, 2, False, "gpu") == 4096     # z only
    assert chunk_rows_for(16384, 151936, 2, True, "gpu") * 151936 * 4 <= CHUNK_BYTES
    assert chunk_rows_for(100, 151936, 2, True, "gpu") == 100          # never more than N
    assert chunk_rows_for(16384, 151936, 4, True, "cpu") == 16          # CPU: cache-sized blocks
    assert chunk_rows_for(5, 10 ** 9, 4, True, "gpu") == 1             # at least one row


@pytest.mark.parametrize("kd", [{"divergence": "reverse_kl", "temperature": 1.3}, {"divergence": "jsd", "beta": 0.4},
                                {"support": "union", "k": 3, "divergence": "forward_kl", "mass": "tail"},
                                # -1e4 / T within reach of the real logits: padding would get mass, and gradient
                                {"divergence": "forward_kl", "temperature": 3000.0}], ids=_ids)
def test_vocabulary_padding_columns(kd):
    """Padding columns: the constant logit for student and teacher, no gradient to their rows."""
    h, w, ht, wt = make_inputs(5)
    _, _, d_w = assert_rows_match(h, w, HiddenTeacher(ht, wt), BACKENDS[0], vocab_end=V - 7,
                                  teacher_vocab_end=V - 9, chunk_rows=4, **kd)
    assert d_w[V - 7:].abs().max().item() == 0.0


def test_tied_weights_and_no_gradient_to_the_teacher():
    """One parameter as embedding and output layer: its gradient is the sum of both uses; the
    teacher's hidden states and weight get none (even when they require one)."""
    _, w, ht, wt = make_inputs(7)
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))
    hid = w.shape[1]
    mix = torch.randn(hid, hid, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / hid ** 0.5
    c = torch.rand(N, generator=torch.Generator().manual_seed(2)).double()
    grads = []
    for materialise in (True, False):
        dtype = torch.float64 if materialise else torch.float32
        emb = torch.nn.Parameter(w.clone().to(dtype))
        hidden = torch.tanh(emb[tokens] @ mix.to(dtype))
        if materialise:
            loss = reference_kd_loss(hidden @ emb.T, DenseTeacher(ht @ wt.T), divergence="jsd", beta=0.3)
            (loss * c).sum().backward()
        else:
            t_h, t_w = ht.float().requires_grad_(), wt.float().requires_grad_()
            scalar, _, _ = linear_kd_loss_weighted(hidden, emb, HiddenTeacher(t_h, t_w), c.float(), divergence="jsd",
                                                   beta=0.3, chunk_rows=4)
            scalar.backward()
            assert t_h.grad is None and t_w.grad is None
        grads.append(emb.grad)
    assert_close_to_max(grads[1], grads[0], 2e-5, "tied weight gradient")


def test_stats_match_the_other_engines():
    h, w, ht, wt = make_inputs(8)
    c = torch.ones(N)
    _, _, stats = linear_kd_loss_weighted(h.float(), w.float(), HiddenTeacher(ht.float(), wt.float()), c,
                                          temperature=2.0, chunk_rows=4)
    u = ht @ wt.T
    torch.testing.assert_close(stats.lse.double(), torch.stack([torch.logsumexp(h @ w.T / 2, 1),
                                                                torch.logsumexp(u / 2, 1)], 1), atol=1e-5, rtol=1e-6)
    assert torch.equal(stats.teacher_top1, u.argmax(1))
    _, _, topk = linear_kd_loss_weighted(h.float(), w.float(), cases.make_topk(u, 4), c, support="teacher",
                                         chunk_rows=4)
    assert (topk.teacher_top1 == -1).all() and topk.student_mass[2].item() == 0.0


def test_float64_takes_the_reference_path_and_zero_weights_hide_nan_rows():
    h, w, ht, wt = make_inputs(11)
    c = torch.rand(N, dtype=torch.float64)
    scalar, loss, stats = linear_kd_loss_weighted(h, w, HiddenTeacher(ht, wt), c, divergence="reverse_kl")
    assert stats is None and scalar.dtype == torch.float64
    want = reference_kd_loss(h @ w.T, DenseTeacher(ht @ wt.T), divergence="reverse_kl")
    torch.testing.assert_close(scalar, (c * want).sum())
    ht = ht.float().clone()
    ht[3] = float("nan")
    c = torch.ones(N)
    c[3] = 0.0
    scalar, loss, _ = linear_kd_loss_weighted(h.float(), w.float(), HiddenTeacher(ht, wt.float()), c,
                                              validate=False, chunk_rows=4)
    assert torch.isnan(loss[3]) and torch.isfinite(scalar)


def test_gradients_only_once_and_none_without_grad_mode():
    h, w, ht, wt = make_inputs(12)
    hh = h.float().requires_grad_()
    scalar, _, _ = linear_kd_loss_weighted(hh, w.float(), HiddenTeacher(ht.float(), wt.float()), torch.ones(N))
    scalar.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="handed out once"):
        scalar.backward()
    with torch.no_grad():   # an evaluation pass: the loss, no gradient GEMMs
        again, _, _ = linear_kd_loss_weighted(hh, w.float(), HiddenTeacher(ht.float(), wt.float()), torch.ones(N))
    assert again.grad_fn is None and torch.equal(again, scalar.detach())


@pytest.mark.parametrize("bad, match", [
    (torch.ones(N - 1), r"^row_weights: expected a floating tensor of shape \[N=9\]"),
    (torch.ones(N, 1), r"^row_weights: expected a floating tensor of shape \[N=9\]"),
    (torch.ones(N, dtype=torch.long), r"^row_weights: expected a floating tensor"),
    ([1.0] * N, r"^row_weights: expected a floating tensor"),
    (torch.full((N,), float("nan")), "^row_weights: expected finite values"),
    (torch.full((N,), float("inf")), "^row_weights: expected finite values"),
])
def test_bad_row_weights_are_a_value_error(bad, match):
    h, w, ht, wt = make_inputs(10)
    with pytest.raises(ValueError, match=match):
        linear_kd_loss_weighted(h.float(), w.float(), HiddenTeacher(ht.float(), wt.float()), bad)
    with pytest.raises(ValueError, match="^row_weights: expected"):   # the kernels' own check (shape, dtype)
        rows_linear_kd_loss(h.float(), w.float(), ht.float(), wt.float(), row_weights=torch.ones(N + 1))


def test_dw_accumulation_precision_in_bfloat16():
    """bf16 at 8 chunks vs float64 logits: the float32 accumulator equals one GEMM over all rows (the
    unfused path); adding chunks into the bf16 buffer adds a rounding per chunk, small beside the
    error of the bf16 logits themselves (the measurement behind DW_FLOAT32_BYTES)."""
    n, hid, v = 512, 64, 1024
    g = torch.Generator().manual_seed(0)
    h, ht = (torch.randn(n, hid, generator=g).bfloat16() for _ in range(2))
    w, wt = ((torch.randn(v, hid, generator=g) * 2.5 / hid ** 0.5).bfloat16() for _ in range(2))
    c = torch.full((n,), 1.0 / n)
    _, _, want = reference(h, w, HiddenTeacher(ht, wt), c.double())
    err = {}
    for chunk_rows, dw_float32 in ((n, None), (n // 8, True), (n // 8, False)):
        ww = w.clone().requires_grad_()
        rows_linear_kd_loss(h, ww, ht, wt, row_weights=c, chunk_rows=chunk_rows, dw_float32=dw_float32)[0].backward()
        err[chunk_rows, dw_float32] = float((ww.grad.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    one_gemm, f32, bf16 = err[n, None], err[n // 8, True], err[n // 8, False]
    assert one_gemm < 0.03 and f32 == pytest.approx(one_gemm, rel=1e-3)
    assert one_gemm < bf16 < 1.15 * one_gemm, err


def _agg_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    t = 17
    mask = (torch.rand(t, generator=g) > 0.3).float()
    seq_ids = torch.tensor([0] * 5 + [1] * 4 + [2] * 3 + [4] * 5)   # sequence 3 has no token
    mask[9:12] = 0                                                  # sequence 2 has no valid token
    return t, mask, seq_ids, torch.rand(5, generator=g) + 0.1


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("global_denominators", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_aggregate_row_weights_are_the_gradient_of_aggregate(mode, global_denominators, weighted):
    t, mask, seq_ids, seq_weights = _agg_inputs(0)
    kw = {"seq_weights": seq_weights if weighted else None, "num_seqs": 5}
    if global_denominators:
        kw.update(global_num_tokens=40, global_num_seqs=7.5)
    tokens = kw.pop("global_num_tokens", None)
    per_token = torch.randn(t, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    scalar = aggregate(per_token, mask, seq_ids, mode, tokens, **kw)
    scalar.backward()
    c = aggregate_row_weights(mask, seq_ids, mode, tokens, dtype=torch.float64, **kw)
    torch.testing.assert_close(c, per_token.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close((c * per_token.detach()).sum(), scalar.detach())
    assert c[mask == 0].abs().max().item() == 0.0


# ---------------------------------------------------------------- TP=2 over gloo
TP_CASES = [
    ({"divergence": "jsd", "beta": 0.3, "temperature": 1.5}, "hidden"),
    ({"divergence": "reverse_kl", "vocab_end": 2 * V - 6, "teacher_vocab_end": 2 * V - 6}, "hidden"),
    ({"support": "union", "k": 4, "divergence": "forward_kl", "mass": "tail", "coverage_coef": 0.3}, "hidden"),
    ({"support": "teacher", "divergence": "jsd", "beta": 0.6, "mass": "renorm", "coverage_coef": 1.0}, "topk"),
]


def tp_worker(rank, world, impl, env_cases):
    """Each rank: its vocabulary shard of W and W_t; the scalar, sum_r d/dh and its dW rows vs TP=1."""
    import torch.distributed as dist

    out = []
    for kd, kind in env_cases:
        h, w, ht, wt = make_inputs(12, v=2 * V)
        teacher = HiddenTeacher(ht, wt) if kind == "hidden" else cases.make_topk(ht @ wt.T, k=7)
        weights = (torch.rand(N, generator=torch.Generator().manual_seed(0)) + 0.5).double()
        ref_loss, ref_dh, ref_dw = reference(h, w, teacher, weights, **kd)
        shard = slice(rank * V, (rank + 1) * V)
        local = HiddenTeacher(ht.float(), wt[shard].float()) if kind == "hidden" else teacher
        scalar, loss, d_h, d_w, _ = rows(h.float(), w[shard].float(), local, weights, impl,
                                         tp_group=dist.group.WORLD, chunk_rows=4, **kd)
        dist.all_reduce(d_h)   # Megatron's TP region: the hidden-state gradient summed over ranks
        torch.testing.assert_close(loss.double(), ref_loss, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(scalar.double(), (weights * ref_loss).sum(), atol=2e-4, rtol=1e-4)
        assert_close_to_max(d_h, ref_dh, 2e-5, f"d/dhidden {kd}")
        assert_close_to_max(d_w, ref_dw[shard], 2e-5, f"d/dweight {kd}")
        out.append(loss.tolist() + [scalar.item()])
    return out


def test_tp2_over_gloo_matches_the_full_vocabulary():
    per_rank = run_distributed(tp_worker, 2, BACKENDS[0], TP_CASES)
    assert per_rank[0] == per_rank[1]   # loss and scalar bit-identical on every rank


def test_bench_method_runs_on_cpu_tensors():
    """`tools/bench_lm_head.py`'s rows method (its inputs are made on a GPU there; here on CPU)."""
    bench = pytest.importorskip("tools.bench_lm_head")
    g = torch.Generator().manual_seed(0)
    h, w, ht, wt = (torch.randn(n, 16, generator=g).bfloat16() for n in (64, 100, 64, 100))
    ids = torch.rand(64, 100, generator=g).topk(8, dim=1).indices
    topk = (ids, torch.log_softmax(torch.randn(64, 8, generator=g), dim=1))
    for name, dense, teacher_topk in (("jsd", (ht, wt), None), ("topk256", None, topk)):
        run, flops = bench.m_rows(16)(h, w, dense, teacher_topk, bench.LM_HEAD_OBJECTIVES[name], None)
        d_h, d_w = run()
        assert flops == 2 * 64 * 100 * (3 * 16 + (16 if dense else 0))   # the 4 products of `gemms`
        assert d_h.shape == h.shape and d_w.shape == w.shape and torch.isfinite(d_w.float()).all()
