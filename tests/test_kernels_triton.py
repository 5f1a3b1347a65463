"""Triton fused-KD kernels under TRITON_INTERPRET=1 on CPU: every objective vs the float64 brute force.

Values and gradients, odd shapes, grad_output != 1, float32 and bfloat16 inputs, padding rows,
extreme logits, in-place gradients, and TP=2 over gloo (real processes) against the full vocabulary.

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
    cases.assert_matches(z, DenseTeacher(t), "triton", divergence="jsd", beta=0.2, tol=tol)
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
CASES.update({
    "topk-all-padding-row-zero": (_topk_all_padding_row, ()),
    "bf16-topk-jsd-tail": (_bf16_topk, ()),
    "extreme-logits-finite": (_extreme_logits, ()),
    "grad-in-place-into-logits": (_in_place, ()),
    "in-place-other-consumer-raises": (_in_place_other_consumer_fails_loudly, ()),
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
