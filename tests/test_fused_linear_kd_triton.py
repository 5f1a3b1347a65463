"""The Triton tiles of the fused LM-head loss under TRITON_INTERPRET=1 on CPU, vs the float64 brute force.

The tiles' shared logit block (`_logit_tile.py`) against float64 on its own, then a few cases of
every kind (the chunked twin runs the whole case table in test_fused_linear_kd.py): dense forward /
reverse KL / JSD in float32 and bfloat16, top-k teacher with tail and raw mass and coverage, dense
teacher on a teacher / union support, vocabulary padding, several row and column blocks in every
pass, the teacher top-1 of the stats pass, TP=2 over gloo, and the rows engine (`linear_kd_rows.py`)
with these logits kernels. As in test_kernels_triton.py, every case runs in a spawned process that
starts with the interpreter on, and each test reports its own case.
"""
from __future__ import annotations

import traceback

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl

from opkd_kernels._jit import lazy_jit
from opkd_kernels._logit_tile import dot_operands, logit_tile
from opkd_kernels.linear_kd_common import PAD_LOGIT
from opkd_mcore.losses import HiddenTeacher
from tests import kernels_cases as cases
from tests import test_fused_linear_kd as lk
from tests._dist import run_distributed

INTERPRETER_ENV = {"TRITON_INTERPRET": "1"}


def _engine(**cfg):
    from dataclasses import replace

    from opkd_kernels.linear_kd_triton import TritonLinearKd, default_config

    return TritonLinearKd(replace(default_config(), **cfg))


def _tile_kernel(x_ptr, w_ptr, out_ptr, N, V, H, x_rs, w_rs, end, inv_T,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok, col_ok = rows < N, cols < V
    z = logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, x_rs, w_rs, end, inv_T,
                   DOT_DTYPE, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * V + cols[None, :], z, mask=row_ok[:, None] & col_ok[None, :])


_TILE_KERNEL = lazy_jit(_tile_kernel)


def _logit_tile():
    """The tile kernels' shared logit block (`_logit_tile.py`) vs float64 `h W^T / T`: ragged row,
    column and hidden blocks (37 x 45 x 70 in 16 x 16 x 16 tiles), operands with row strides wider
    than H, and the padding columns past `end` at PAD_LOGIT / T."""
    g = torch.Generator().manual_seed(11)
    n, v, h, end, temperature = 37, 45, 70, 40, 1.3
    x = torch.randn(n, h + 3, generator=g)[:, :h]
    w = torch.randn(v, h + 5, generator=g)[:, :h] / h ** 0.5
    out = torch.full((n, v), float("nan"))
    dot_dtype, precision = dot_operands(x)
    _TILE_KERNEL.get()[(3, 3)](x, w, out, n, v, h, x.stride(0), w.stride(0), end, 1.0 / temperature,
                               DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, BLOCK_N=16, BLOCK_V=16, BLOCK_K=16)
    want = x.double() @ w.double().T / temperature
    torch.testing.assert_close(out[:, :end].double(), want[:, :end], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, end:].double(), torch.full((n, v - end), PAD_LOGIT / temperature,
                                                                 dtype=torch.float64), rtol=1e-6, atol=0.0)


def _dense(kd, dtype):
    h, w, ht, wt = lk.make_inputs(1)
    lk.assert_matches(h, w, HiddenTeacher(ht, wt), _engine(), dtype=dtype, **kd)


def _topk(kd):
    h, w, ht, wt = lk.make_inputs(2)
    loss, d_h, _ = lk.assert_matches(h, w, cases.make_topk(ht @ wt.T, k=6), _engine(), support="teacher", **kd)
    assert loss[2].item() == 0.0 and d_h[2].abs().max().item() == 0.0


def _dense_support(kd):
    h, w, ht, wt = lk.make_inputs(3)
    lk.assert_matches(h, w, HiddenTeacher(ht, wt), _engine(), **kd)


def _padding():
    h, w, ht, wt = lk.make_inputs(5)
    _, _, d_w = lk.assert_matches(h, w, HiddenTeacher(ht, wt), _engine(), vocab_end=lk.V - 7,
                                  teacher_vocab_end=lk.V - 9, divergence="reverse_kl", temperature=1.3)
    assert d_w[lk.V - 7:].abs().max().item() == 0.0


def _many_blocks():
    """37 rows x 41 columns: 3 row tiles, 3 vocabulary splits, 3 x 3 gradient blocks."""
    h, w, ht, wt = lk.make_inputs(6, n=37)
    engine = _engine(num_splits=3, grad_block_cols=16, grad_block_bytes=16 * 16 * 2)
    lk.assert_matches(h, w, HiddenTeacher(ht, wt), engine, divergence="jsd", beta=0.6)
    lk.assert_matches(h, w, cases.make_topk(ht @ wt.T, k=5), engine, support="teacher", mass="tail",
                      coverage_coef=0.4)


def _teacher_top1():
    from opkd_mcore.losses import linear_kd_loss_with_stats

    h, w, ht, wt = lk.make_inputs(8)
    _, stats = linear_kd_loss_with_stats(h.float(), w.float(), HiddenTeacher(ht.float(), wt.float()),
                                         engine=_engine(num_splits=3))
    assert torch.equal(stats.teacher_top1, (ht @ wt.T).argmax(1))


def _rows_engine():
    """The rows engine with the Triton logits kernels: bf16 logits chunks, dense and top-k teachers."""
    from tests import test_fused_linear_kd_rows as rows

    h, w, ht, wt = lk.make_inputs(9)
    rows.assert_rows_match(h, w, HiddenTeacher(ht, wt), "triton", dtype=torch.bfloat16, chunk_rows=4,
                           divergence="jsd", beta=0.3, temperature=1.3)
    rows.assert_rows_match(h, w, cases.make_topk(ht @ wt.T, k=6), "triton", chunk_rows=2, support="teacher",
                           mass="tail", coverage_coef=0.2)


def _rows_teacher_top1_and_scale():
    """The rows engine's gradient pass writes the teacher's row maxima: on tied maxima (columns 5, 35
    and 37: two lanes of the interpreter's 32-column blocks, one of them twice) the first column, as
    argmax; without a gradient the engine's own max(dim=1). The gradients' in-place scaling kernel
    equals mul_ (several blocks, a partial one), and non-contiguous tensors take mul_ itself."""
    from opkd_kernels.kd_scale import scale_
    from opkd_mcore.losses import linear_kd_loss_weighted

    h, w, ht, wt = (x.float() for x in lk.make_inputs(10))
    ht[:, 0], wt[:, 0] = 8.0, 0.0
    wt[5, 0] = 2.0
    wt[35] = wt[37] = wt[5]
    u = ht @ wt.T
    assert torch.equal(u.argmax(1), torch.full((lk.N,), 5)) and torch.equal(u[:, 5], u[:, 37])
    for grad in (True, False):
        hh = h.clone().requires_grad_(grad)
        _, _, stats = linear_kd_loss_weighted(hh, w, HiddenTeacher(ht, wt), torch.ones(lk.N), impl="triton",
                                              chunk_rows=4)
        assert torch.equal(stats.teacher_top1, u.argmax(1)), (grad, stats.teacher_top1)
    g = torch.tensor(0.37)
    for x in (torch.randn(3, 3001), torch.randn(3001, 3).bfloat16().T):
        assert torch.equal(scale_(x.clone(), g), x.clone().mul_(g))
    # the interpreter converts float32 to bf16 by truncation, not rounding: within one bf16 spacing
    # here (tests/test_kernels_gpu.py checks the compiled kernel's rounding bit for bit)
    x = torch.randn(3, 3001).bfloat16()
    exact = x.float() * g
    assert ((scale_(x.clone(), g).float() - exact).abs() <= exact.abs() * 2.0 ** -7).all()


CASES = {}
for _kd, _dt in [(dict(divergence="forward_kl"), torch.float32), (dict(divergence="forward_kl"), torch.bfloat16),
                 (dict(divergence="reverse_kl", temperature=1.7), torch.float32),
                 (dict(divergence="jsd", beta=0.3, temperature=0.6), torch.bfloat16),
                 (dict(divergence="jsd", beta=1.0), torch.float32)]:
    CASES[f"dense-{lk._ids(_kd)}-{_dt}"] = (_dense, (_kd, _dt))
for _kd in [cases.TOPK_CASES[1], cases.TOPK_CASES[2], cases.TOPK_CASES[7]]:
    CASES[f"topk-{lk._ids(_kd)}"] = (_topk, (_kd,))
for _kd in [cases.DENSE_SUPPORT_CASES[0], cases.DENSE_SUPPORT_CASES[2]]:
    CASES[f"dense-support-{lk._ids(_kd)}"] = (_dense_support, (_kd,))
CASES.update({"logit-tile": (_logit_tile, ()), "vocabulary-padding": (_padding, ()), "many-blocks": (_many_blocks, ()),
              "teacher-top1": (_teacher_top1, ()), "rows-engine": (_rows_engine, ()),
              "rows-teacher-top1-and-scale": (_rows_teacher_top1_and_scale, ())})


def _run_all_cases(rank, world):
    outcome = {}
    for name, (fn, args) in CASES.items():
        try:
            fn(*args)
            outcome[name] = None
        except Exception:  # reported per case by the tests below
            outcome[name] = traceback.format_exc()
    return outcome


def _spawn_interpreted(fn, world_size, *args):
    with pytest.MonkeyPatch.context() as mp:
        for key, value in INTERPRETER_ENV.items():
            mp.setenv(key, value)
        return run_distributed(fn, world_size, *args, env=INTERPRETER_ENV)


@pytest.fixture(scope="module")
def interpreter_outcomes():
    return _spawn_interpreted(_run_all_cases, 1)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter_case(interpreter_outcomes, name):
    assert interpreter_outcomes[name] is None, interpreter_outcomes[name]


def test_tp2_over_gloo_matches_the_full_vocabulary():
    per_rank = _spawn_interpreted(lk.tp_worker, 2, "triton", [lk.TP_CASES[0], lk.TP_CASES[2], lk.TP_CASES[4]])
    assert per_rank[0] == per_rank[1]
