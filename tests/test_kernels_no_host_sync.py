"""The fused losses never make the host wait for the device, in forward or backward.

A host sync inside the loss stalls the trainer: the host cannot queue the backward while the
stats pass runs, so the device idles for the host's Python in between. On 2026-11-25 one Python
list index (`stats[:, [0, 2]]`: a host index tensor copied to the device, a blocking copy) cost
~1.5 ms of a 9 ms forward-KL call on an H200.

On CPU every op runs synchronously, so the check is on what the ops are (`tests/_host_sync.py`);
`tests/test_kernels_gpu.py` runs the same calls under `torch.cuda.set_sync_debug_mode("error")`.
"""
from __future__ import annotations

import pytest
import torch

from opkd_kernels import cpu_backend
from opkd_kernels.fused_kd import KdSpec, fused_kd_loss
from opkd_kernels.fused_linear_kd import fused_linear_kd_loss
from opkd_kernels.linear_kd_rows import rows_linear_kd_loss
from opkd_mcore.losses import DenseTeacher, TopKTeacher
from opkd_mcore.losses.aggregation import aggregate, aggregate_row_weights
from opkd_mcore.losses.kd_loss import kd_loss_with_stats
from tests._host_sync import SyncingOpRecorder

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="the C++ twin is not built")

N, V, H = 12, 97, 16


def _teacher(dense: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(N, V, generator=g) * 2
    if dense:
        return t, None, None
    ids = torch.randint(0, V, (N, 6), generator=g)
    return None, ids, torch.log_softmax(torch.randn(N, 6, generator=g), dim=1)


SPECS = [
    pytest.param(KdSpec(), True, id="forward_kl"),
    pytest.param(KdSpec(divergence="reverse_kl", temperature=1.5), True, id="reverse_kl"),
    pytest.param(KdSpec(divergence="jsd", beta=0.3), True, id="jsd"),
    pytest.param(KdSpec(support="union", k=4, mass="tail", coverage_coef=0.2), True, id="dense-union"),
    pytest.param(KdSpec(support="teacher"), False, id="topk-renorm"),
    pytest.param(KdSpec(support="teacher", divergence="jsd", mass="tail"), False, id="topk-jsd-tail"),
]


def _assert_no_sync(fn):
    with SyncingOpRecorder() as rec:
        fn()
    assert not rec.seen, f"host-synchronising ops in the fused loss: {sorted(set(rec.seen))}"


@pytest.mark.parametrize("spec,dense", SPECS)
def test_logits_loss_forward_and_backward(spec, dense):
    t, ids, logprobs = _teacher(dense, seed=1)
    leaf = (torch.randn(N, V, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()

    def step():
        loss = fused_kd_loss(leaf, t, ids, logprobs, spec=spec, backend="cpp", inplace_grad=False)
        torch.autograd.grad(loss.sum(), leaf)
    _assert_no_sync(step)


def _lm_head_operands(dense: bool):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_()
    if not dense:
        _, ids, logprobs = _teacher(False, seed=4)
        return h, w, None, None, ids, logprobs
    return h, w, torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / H ** 0.5, None, None


@pytest.mark.parametrize("spec,dense", SPECS)
def test_lm_head_chunked_engine(spec, dense):
    h, w, ht, wt, ids, logprobs = _lm_head_operands(dense)

    def step():
        loss = fused_linear_kd_loss(h, w, ht, wt, ids, logprobs, spec=spec, backend="cpp",
                                    student_vocab_end=V - 3, teacher_vocab_end=V - 5)
        torch.autograd.grad(loss.sum(), (h, w))
    _assert_no_sync(step)


@pytest.mark.parametrize("spec,dense", SPECS)
def test_lm_head_rows_engine(spec, dense):
    h, w, ht, wt, ids, logprobs = _lm_head_operands(dense)
    row_weights = torch.full((N,), 1.0 / N)

    def step():
        out = rows_linear_kd_loss(h, w, ht, wt, ids, logprobs, row_weights=row_weights, spec=spec,
                                  backend="cpp", chunk_rows=5, student_vocab_end=V - 3,
                                  teacher_vocab_end=V - 5)
        torch.autograd.grad(out[0], (h, w))
    _assert_no_sync(step)


@pytest.mark.parametrize("impl", ["cpp", "reference"])
@pytest.mark.parametrize("spec,dense", SPECS)
def test_kd_loss_with_stats_unvalidated(spec, dense, impl):
    """The public entry point the trainer calls (`validate=False`: content checks are the syncs it
    opts out of), with its logging stats, and the aggregation with the batch's sequence count."""
    t, ids, logprobs = _teacher(dense, seed=5)
    teacher = DenseTeacher(t) if dense else TopKTeacher(ids, logprobs)
    z = (torch.randn(N, V, generator=torch.Generator().manual_seed(6)) * 2).requires_grad_()
    opts = {k: getattr(spec, k) for k in ("divergence", "beta", "temperature", "support", "k", "mass",
                                          "coverage_coef")}
    seq_ids = torch.arange(N) // 5
    mask = torch.ones(N)

    def step():
        loss, _stats = kd_loss_with_stats(z, teacher, impl=impl, validate=False, overlap_k=4, **opts)
        scalar = aggregate(loss, mask, seq_ids, mode="seq-mean-token-mean", num_seqs=3)
        scalar.backward()
        aggregate_row_weights(mask, seq_ids, mode="seq-mean-token-mean", num_seqs=3)
    _assert_no_sync(step)


def test_the_recorder_sees_a_list_index():
    """The check can fail: the pattern that slipped in before is caught."""
    stats = torch.randn(4, 6)
    with SyncingOpRecorder() as rec:
        stats[:, [0, 2]].contiguous()
    assert any(op.startswith("aten.lift_fresh") for op in rec.seen), rec.seen
