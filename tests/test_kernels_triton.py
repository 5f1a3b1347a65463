"""Triton fused-KD kernels under TRITON_INTERPRET=1 on CPU: every objective vs the float64 brute force.

Values and gradients, odd shapes, grad_output != 1, float32 and bfloat16 inputs, padding rows,
extreme logits, in-place gradients, and TP=2 over gloo (real processes) against the full vocabulary.
The one-launch sparse objective (`kd_sparse_objective`) is also compared directly with its torch
autograd oracle `sparse_objective_and_grads` on edge-case rows, for every kind x mass x coverage.

Triton picks interpreter or compiler when it is first imported, and other tests in the same
pytest process may import it first; so every case runs in a spawned process that starts with
TRITON_INTERPRET=1 (one process for all single-rank cases, two for TP=2), and each test here
reports its own case's outcome.
"""
from __future__ import annotations

import traceback

import pytest
import torch

pytest.importorskip("triton")

from opkd_mcore.losses import DenseTeacher  # noqa: E402
from tests import kernels_cases as cases  # noqa: E402
from tests._dist import run_distributed  # noqa: E402

N, V = 7, 67
INTERPRETER_ENV = {"TRITON_INTERPRET": "1"}


def _dense(kd, dtype):
    z, t = cases.make_logits(N, V, seed=1)
    cases.assert_matches(z, DenseTeacher(t), "triton", dtype=dtype, **kd)


def _topk(kd):
    z, t = cases.make_logits(N, 131, seed=2)
    cases.assert_matches(z, cases.make_topk(t, k=6), "triton", support="teacher", **kd)


def _topk_all_padding_row():
    z, t = cases.make_logits(N, 37, seed=3)
    loss, grad = cases.assert_matches(z, cases.make_topk(t, k=4), "triton", support="teacher", mass="tail",
                                      coverage_coef=0.5)
    assert loss[2].item() == 0.0 and grad[2].abs().max().item() == 0.0


def _dense_support(kd):
    z, t = cases.make_logits(N, 61, seed=4)
    cases.assert_matches(z, DenseTeacher(t), "triton", **kd)


def _bf16_topk():
    z, t = cases.make_logits(N, 97, seed=5)
    cases.assert_matches(z, cases.make_topk(t, k=5), "triton", dtype=torch.bfloat16, support="teacher",
                         divergence="jsd", beta=0.5, mass="tail")


def _extreme_logits():
    z, t = cases.make_logits(N, V, seed=6, scale=40.0)   # logit gaps of hundreds: exp underflows
    # log-ratios of ~500 in float32 carry ~5e-5 absolute error; the point here is "finite and right"
    tol = (5e-4, 1e-4)
    cases.assert_matches(z, DenseTeacher(t), "triton", divergence="reverse_kl", tol=tol)
    for beta in (0.2, 0.001, 0.999):   # m = beta p + (1 - beta) q in linear space, either term tiny
        cases.assert_matches(z, DenseTeacher(t), "triton", divergence="jsd", beta=beta, tol=tol)
    cases.assert_matches(z, cases.make_topk(t, k=5), "triton", support="teacher", mass="tail",
                         divergence="reverse_kl", tol=tol)


def _in_place():
    from opkd_mcore.losses.fused import fused_kd_loss_or_none

    z, t = cases.make_logits(N, V, seed=7)
    _, ref_grad = cases.reference(z, DenseTeacher(t), torch.ones(N, dtype=torch.float64))
    leaf = z.float().requires_grad_()
    logits = leaf * 1.0                       # a model output (non-leaf), like Megatron's logits
    seen = {}

    def record_grad_pointer(grad):
        seen["ptr"] = grad.data_ptr()

    logits.register_hook(record_grad_pointer)
    fused_kd_loss_or_none(logits, DenseTeacher(t.float()), backend="triton").sum().backward()
    assert seen["ptr"] == logits.data_ptr(), "gradient was not written into the logits buffer"
    torch.testing.assert_close(leaf.grad.double(), ref_grad, atol=2e-6, rtol=1e-4)


def _in_place_other_consumer_fails_loudly():
    from opkd_mcore.losses.fused import fused_kd_loss_or_none

    z, t = cases.make_logits(N, V, seed=8)
    logits = z.float().requires_grad_() * 1.0
    other = (logits ** 2).sum()               # saves `logits` for its own backward
    loss = fused_kd_loss_or_none(logits, DenseTeacher(t.float()), backend="triton").sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def _sparse_objective_inputs(k: int, seed: int):
    """float32 [9, k] inputs of the sparse objective, one edge case per row."""
    import math

    n = 9
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(n, k + 5, generator=g, dtype=torch.float64) * 2
    log_p = torch.log_softmax(teacher, dim=1)[:, :k].clone()
    valid = torch.ones(n, k, dtype=torch.bool)
    off_support = torch.rand(n, generator=g, dtype=torch.float64) * 2 + 0.05   # lse - lse_S
    valid[1, k // 2:] = False                           # padding carrying garbage, to be ignored
    s[1, k // 2:], log_p[1, k // 2:] = float("nan"), 0.0
    valid[2], log_p[2] = False, float("-inf")           # all padding: loss 0, gradient 0
    p = torch.full((k,), 1e-9 / (k - 1), dtype=torch.float64)
    p[0] = 1.0 - 2e-9
    log_p[3] = p.log()                                  # very peaked teacher: tail mass 1e-9
    log_p[4] = -math.log(1e5)                           # very flat teacher: tail mass ~1
    log_p[5, 1] = float("-inf")                         # a valid entry with teacher probability 0
    off_support[6] = 1e-6                               # student mass on S 1 - 1e-6
    off_support[7] = -1e-4                              # lse < lse_S (rounding): student tail floors
    valid[8, 0] = False                                 # leading padding, peaked student
    s[8, 1] += 30.0
    lse = torch.logsumexp(s.masked_fill(~valid, float("-inf")), dim=1) + off_support
    lse[2] = 1.5
    # lse as a strided view, like the [N, 2] row stats the fused loss passes
    lse = torch.stack([lse, torch.zeros_like(lse)], dim=1).float()[:, 0]
    return s.float(), lse, log_p.float(), valid


def _sparse_objective_vs_torch(kind, beta, mass):
    from opkd_kernels.fused_kd import support_masses
    from opkd_kernels.kd_sparse_objective import sparse_objective
    from opkd_kernels.sparse_objective import sparse_objective_and_grads

    for k in (7, 6):
        s, lse, log_p, valid = _sparse_objective_inputs(k, seed=k)
        for coverage in (0.0, 0.4):
            args = (s, lse, log_p, valid, kind, beta, mass, coverage)
            expected = (*sparse_objective_and_grads(*args), *support_masses(s.double(), lse.double(),
                                                                           log_p.double(), valid))
            got = sparse_objective(*args)
            for name, a, b in zip(("loss", "d_s", "d_lse", "teacher mass", "student mass"), got, expected):
                assert a.dtype == torch.float32 and a.shape == b.shape, name
                b = b.to(a.dtype)
                # both are float64 inside; reverse KL with the p = 0 entry of row 5 is +inf (NaN
                # gradients) in both, hence equal_nan
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True,
                                           msg=lambda m: f"{name} k={k} coverage={coverage}: {m}")
            assert got[0][2].item() == 0.0 and not got[1][2].any() and got[2][2].item() == 0.0
            assert not got[1][1, k // 2:].any() and not got[1][8, 0].any()
            loss_only = sparse_objective(*args, need_grad=False)
            assert loss_only[1] is None and loss_only[2] is None
            for a, b in zip(loss_only[::3] + loss_only[4:], got[::3] + got[4:]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    empty = sparse_objective(s[:0], lse[:0], log_p[:0], valid[:0], kind, beta, mass, 0.4)
    assert [t.shape for t in empty] == [(0,), (0, 6), (0,), (0,), (0,)]


def _row_stats_primitive():
    """`kd_row_stats.row_stats` against float64: maxima and sums at T != 1, -inf logits, rows that
    span several blocks and one that ends mid-block, and `want` (a column not wanted is 0)."""
    from opkd_kernels.kd_row_stats import row_stats

    z, t = cases.make_logits(N, 83, seed=11)
    z[1, :40], t[2, 5:] = float("-inf"), float("-inf")    # a student and a teacher mostly -inf
    inv_t = 1 / 1.7
    s, u = z.double() * inv_t, t.double() * inv_t
    m_s, m_u = s.amax(1), u.amax(1)
    e_s, e_u = (s - m_s[:, None]).exp(), (u - m_u[:, None]).exp()
    # a teacher mass where the student is -inf makes a = +inf (and b the other way round), as it
    # should: the divergence is infinite there; a zero weight times an infinite log-ratio is 0
    a = (e_u * torch.where(e_u > 0, u - s, 0.0)).sum(1)
    b = (e_s * torch.where(e_s > 0, s - u, 0.0)).sum(1)
    assert a[1].isinf() and b[2].isinf()
    expected = torch.stack([m_s, e_s.sum(1), m_u, e_u.sum(1), a, b], dim=1)
    for want, zeroed in (("ab", []), ("a", [5]), ("b", [4]), ("", [4, 5])):
        got = row_stats(z.float(), t.float(), inv_t, block_v=16, num_warps=1, want=want).double()
        exp = expected.clone()
        exp[:, zeroed] = 0.0
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5, msg=lambda m, want=want: f"want={want!r}: {m}")
    student_only = row_stats(z.float(), None, inv_t, block_v=16, num_warps=1).double()
    torch.testing.assert_close(student_only[:, :2], expected[:, :2], rtol=1e-5, atol=1e-5)
    assert not student_only[:, 2:].any()


def _support_gather_primitive():
    """`kd_support_gather.support_gather` bitwise against the torch `fused_kd.support_values`: ids
    on this shard, on others and padding, int32 and int64 ids, bf16 and float32 logits, a shard
    with the full vocabulary's row stride and a column-major one."""
    from opkd_kernels.fused_kd import support_values
    from opkd_kernels.kd_support_gather import support_gather

    z, _ = cases.make_logits(N, 2 * 53, seed=12)
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 2 * 53, (N, 9), generator=gen)
    ids[1, 3:] = -1
    ids[4] = -1   # a row of padding only
    offset, v_local = 53, 53
    for dtype in (torch.float32, torch.bfloat16):
        shard = z.to(dtype)[:, offset:]      # a view with the full vocabulary's row stride
        for id_dtype in (torch.int64, torch.int32):
            expected, local_expected = support_values(shard, ids, offset, 1 / 1.3)
            values, local = support_gather(shard, ids.to(id_dtype), offset, 1 / 1.3)
            assert torch.equal(values, expected) and torch.equal(local, local_expected), (dtype, id_dtype)
        values, no_local = support_gather(shard.t().contiguous().t(), ids, offset, 1 / 1.3, with_local=False)
        assert no_local is None and torch.equal(values, expected)
    assert ((local_expected >= 0) == ((ids >= offset) & (ids < offset + v_local))).all()
    assert not values[4].any() and local_expected[4].eq(-1).all()


def _case_id(kd) -> str:
    return "-".join(f"{k}={v}" for k, v in kd.items())


CASES = {}
for _kd in cases.DENSE_CASES:
    for _dt in (torch.float32, torch.bfloat16):
        CASES[f"dense-{_case_id(_kd)}-{_dt}"] = (_dense, (_kd, _dt))
for _kd in cases.TOPK_CASES:
    CASES[f"topk-{_case_id(_kd)}"] = (_topk, (_kd,))
for _kd in cases.DENSE_SUPPORT_CASES:
    CASES[f"dense-support-{_case_id(_kd)}"] = (_dense_support, (_kd,))
for _kind in ("forward_kl", "reverse_kl", "jsd"):
    for _beta in (0.0, 0.3, 1.0):
        for _mass in ("renorm", "tail", "raw"):
            CASES[f"sparse-objective-{_kind}-beta={_beta}-{_mass}"] = (_sparse_objective_vs_torch,
                                                                       (_kind, _beta, _mass))
CASES.update({
    "topk-all-padding-row-zero": (_topk_all_padding_row, ()),
    "bf16-topk-jsd-tail": (_bf16_topk, ()),
    "extreme-logits-finite": (_extreme_logits, ()),
    "grad-in-place-into-logits": (_in_place, ()),
    "in-place-other-consumer-raises": (_in_place_other_consumer_fails_loudly, ()),
    "row-stats-primitive-vs-float64": (_row_stats_primitive, ()),
    "support-gather-primitive-bitwise": (_support_gather_primitive, ()),
})


def _run_all_cases(rank, world):
    outcome = {}
    for name, (fn, args) in CASES.items():
        try:
            fn(*args)
            outcome[name] = None
        except Exception:  # reported per case by the tests below
            outcome[name] = traceback.format_exc()
    return outcome


def _spawn_interpreted(fn, world_size):
    # The children inherit the environment at spawn, before they import anything (triton included).
    with pytest.MonkeyPatch.context() as mp:
        for key, value in INTERPRETER_ENV.items():
            mp.setenv(key, value)
        return run_distributed(fn, world_size, env=INTERPRETER_ENV)


@pytest.fixture(scope="module")
def interpreter_outcomes():
    return _spawn_interpreted(_run_all_cases, 1)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter_case(interpreter_outcomes, name):
    assert interpreter_outcomes[name] is None, interpreter_outcomes[name]


def _tp_worker(rank, world, kd, dense):
    import torch.distributed as dist

    z, t = cases.make_logits(N, 2 * 41, seed=9)
    teacher = DenseTeacher(t) if dense else cases.make_topk(t, k=7)
    v_local = z.shape[1] // world
    shard = slice(rank * v_local, (rank + 1) * v_local)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    ref_loss, ref_grad = cases.reference(z, teacher, weights, **kd)
    local_teacher = DenseTeacher(t[:, shard].float()) if dense else teacher
    loss, grad = cases.fused(z[:, shard].float(), local_teacher, weights, "triton", tp_group=dist.group.WORLD, **kd)
    torch.testing.assert_close(loss.double(), ref_loss, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad.double(), ref_grad[:, shard], atol=2e-6, rtol=1e-4)
    return loss.tolist()   # plain floats: tensors would travel through shared memory of a dead process


TP_CASES = [
    (dict(divergence="jsd", beta=0.3), True),
    (dict(divergence="reverse_kl", temperature=1.5), True),
    (dict(support="union", k=4, divergence="forward_kl", mass="tail", coverage_coef=0.3), True),
    (dict(support="teacher", divergence="forward_kl", mass="raw"), False),
    (dict(support="teacher", divergence="jsd", beta=0.6, mass="renorm", coverage_coef=1.0), False),
]


def _tp_all_cases(rank, world):
    return [_tp_worker(rank, world, kd, dense) for kd, dense in TP_CASES]


def test_tp2_over_gloo_matches_full_vocabulary():
    per_rank = _spawn_interpreted(_tp_all_cases, 2)
    for a, b in zip(*per_rank):
        assert a == b   # bit-identical on every rank
