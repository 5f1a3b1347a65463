"""The fused LM-head loss: `kd_loss` of the logits `hidden @ weight.T`, without the logits.

    per_token = linear_kd_loss(hidden [N, H], weight [V_local, H], teacher, **kd_loss keywords)

`teacher` is a `TopKTeacher` (ids + logprobs) or a `HiddenTeacher` (teacher hidden states
`[N, H_t]` + its output-weight shard `[V_local, H_t]`: exact dense KD; its `vocab_size`, if set, is
the default `teacher_vocab_end`). Every option of `kd_loss`
(divergence, beta, temperature, support, k, mass, coverage_coef, tp_group) has its meaning there;
the contract is "materialise the logits, call kd_loss" (`materialised_linear_kd_loss`, which is also
the `impl="reference"` path, the tests' oracle and the benchmarks' unfused baseline).

Gradients reach `hidden` (this TP rank's partial: the caller's Megatron TP region sums it over the
group, as for `ColumnParallelLinear`) and `weight`. `vocab_end` / `teacher_vocab_end`: global
vocabulary sizes; columns at or past them (padding of the last TP shard) get the logit -1e4, as the
trainer writes into materialised logits, and no gradient.

`linear_kd_loss_weighted(..., row_weights)` returns the scalar `sum_n row_weights[n] loss[n]` (the
"rows" engine, `opkd_kernels.linear_kd_rows`): with the weights known up front, the gradients are
computed in the forward, one chunk of rows at a time, and the logits are formed once.

Dispatch (`impl`): "auto" / "fused" pick the Triton tiles where `platform.triton_kernels_usable`,
else the chunked torch twin (its C++ primitives on CPU when built); "triton" / "cpp" / "torch"
force one; "reference" materialises. float64 inputs take the reference path under "auto".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from opkd_kernels import cpu_backend
from opkd_kernels.fused_kd import COVERED_DTYPES, KdSpec
from opkd_kernels.fused_linear_kd import fused_linear_kd_loss
from opkd_kernels.linear_kd_common import PAD_LOGIT
from opkd_kernels.linear_kd_rows import check_row_weights, rows_linear_kd_loss
from opkd_mcore.losses import validation
from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.kd_loss import kd_loss
from opkd_mcore.losses.support_kd import select_support
from opkd_mcore.losses.teacher_outputs import DenseTeacher, HiddenTeacher, TopKTeacher
from opkd_mcore.platform import device as platform_device

IMPLS = ("auto", "reference", "fused", "triton", "cpp", "torch")


@dataclass(frozen=True)
class LinearKDStats:
    """Per-token by-products for logging (tensors, no host sync): Σ_S p and Σ_S q (1 for the full
    vocabulary), the global log-partitions `lse [N, 2]` (student, teacher; NaN where the teacher's
    values are), and the dense teacher's top-1 id `[N]` (-1 for a top-k teacher)."""

    teacher_mass: torch.Tensor
    student_mass: torch.Tensor
    lse: torch.Tensor
    teacher_top1: torch.Tensor


def engine_name(hidden: torch.Tensor, impl: str = "auto") -> str | None:
    """The engine `impl` uses for `hidden` ("triton" | "cpp" | "torch"), or None (reference path)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "reference" or hidden.dtype not in COVERED_DTYPES:
        return None
    if impl in ("triton", "cpp", "torch"):
        return impl
    if platform_device.triton_kernels_usable(hidden):
        return "triton"
    if hidden.device.type == "cpu":
        if cpu_backend.available():
            return "cpp"
    return "torch"


def _vocab_end(vocab_end: int | None, v_local: int, group) -> int | None:
    """A global vocabulary size -> this shard's first padding column (None: no padding)."""
    if vocab_end is None:
        return None
    return max(0, min(v_local, vocab_end - vp.shard_offset(v_local, group)))


def _check(hidden, weight, teacher, spec: KdSpec, *, tp_group, validate, impl):
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if not isinstance(teacher, (HiddenTeacher, TopKTeacher)):
        raise ValueError(f"teacher: expected HiddenTeacher or TopKTeacher, got {type(teacher).__name__}")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_floating_point()):
            raise ValueError(f"{name}: expected a floating 2-D tensor, got {validation._describe(x)}")
    if weight.shape[1] != hidden.shape[1] or weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected a {hidden.dtype} tensor [V_local, H={hidden.shape[1]}], got "
                         f"{validation._describe(weight)}")
    n, v_local = hidden.shape[0], weight.shape[0]
    as_logits = torch.empty((n, v_local), device="meta", dtype=hidden.dtype)
    stand_in = teacher
    if isinstance(teacher, HiddenTeacher):
        th, tw = teacher.hidden, teacher.weight
        if not (isinstance(th, torch.Tensor) and th.dim() == 2 and th.shape[0] == n
                and th.dtype == hidden.dtype):
            raise ValueError(f"teacher.hidden: expected a {hidden.dtype} tensor [N={n}, H_t], got "
                             f"{validation._describe(th)}")
        want = (v_local, th.shape[1])
        if not (isinstance(tw, torch.Tensor) and tuple(tw.shape) == want and tw.dtype == hidden.dtype):
            raise ValueError(f"teacher.weight: expected a {hidden.dtype} tensor of shape {want} "
                             f"(sharded like the student's weight), got {validation._describe(tw)}")
        stand_in = DenseTeacher(as_logits)
    validation.check_options(stand_in, spec, impl="auto")
    tp = vp.group_size(tp_group)
    validation.check_shapes(as_logits, stand_in, k=spec.k, tp_size=tp)
    if validate:
        if isinstance(teacher, TopKTeacher):
            validation.check_values(teacher, vocab=v_local * tp)
        elif torch.isnan(teacher.hidden).any():
            raise ValueError("teacher.hidden: expected no NaN, found one")


def _masked_logits(x, w, vocab_end, tp_group):
    z = x @ w.T
    local_end = _vocab_end(vocab_end, w.shape[0], tp_group)
    if local_end is not None and local_end < w.shape[0]:
        with torch.no_grad():   # as the trainer masks materialised logits: constants, in place
            z[:, local_end:] = PAD_LOGIT
    return z


@torch.no_grad()
def hidden_teacher_logits(teacher: HiddenTeacher, tp_group=None, vocab_end: int | None = None,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Materialised `[N, V_local]` logits of a `HiddenTeacher` (ids past its vocab_size: -1e4)."""
    end = teacher.vocab_size if vocab_end is None else vocab_end
    w = teacher.weight if dtype is None else teacher.weight.to(dtype)
    return _masked_logits(teacher.hidden.to(w.dtype), w, end, tp_group)


def materialised_linear_kd_loss(hidden, weight, teacher, *, vocab_end=None, teacher_vocab_end=None,
                                tp_group=None, impl="reference", **kd):
    """The unfused path: logits `hidden @ weight.T` (padding columns -1e4), then `kd_loss`."""
    if isinstance(teacher, HiddenTeacher):
        teacher = DenseTeacher(hidden_teacher_logits(teacher, tp_group, teacher_vocab_end))
    return kd_loss(_masked_logits(hidden, weight, vocab_end, tp_group), teacher, tp_group=tp_group,
                   impl=impl, **kd)


def _kernel_operands(weight, teacher, spec: KdSpec, tp_group, vocab_end, teacher_vocab_end):
    """`((h_t, W_t, ids, logprobs), shard-local vocabulary ends)` for the opkd_kernels entries."""
    if isinstance(teacher, HiddenTeacher):
        operands = (teacher.hidden.detach(), teacher.weight.detach(), None, None)
    else:
        # the same choice of ids as kd_loss (top-k of a wider teacher, ties)
        ids, logprobs, _ = select_support(None, teacher, support=spec.support, k=spec.k, group=tp_group)
        operands = (None, None, ids, logprobs)
    v_local = weight.shape[0]
    ends = {"student_vocab_end": _vocab_end(vocab_end, v_local, tp_group),
            "teacher_vocab_end": _vocab_end(teacher_vocab_end, v_local, tp_group)}
    return operands, ends


def linear_kd_loss(hidden, weight, teacher, **kwargs) -> torch.Tensor:
    """Per-token loss `[N]` float32 (float64 for float64 inputs); see the module docstring."""
    return linear_kd_loss_with_stats(hidden, weight, teacher, **kwargs)[0]


def linear_kd_loss_with_stats(hidden: torch.Tensor, weight: torch.Tensor, teacher, *,
                              divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                              support: str | None = None, k: int | None = None, mass: str = "renorm",
                              coverage_coef: float = 0.0, tp_group=None, impl: str = "auto",
                              validate: bool = True, vocab_end: int | None = None,
                              teacher_vocab_end: int | None = None, engine=None):
    """`(per-token loss [N], LinearKDStats | None)`; stats are None on the reference path.

    `engine`: overrides `impl`: an `opkd_kernels` engine object (tests and benchmarks set block sizes)
    or a name `select_linear_engine` takes (the trainer passes its loss plan's `linear_engine`)."""
    spec = validation.objective_spec(divergence=divergence, beta=beta, temperature=temperature,
                                     support=support, k=k, mass=mass, coverage_coef=coverage_coef)
    _check(hidden, weight, teacher, spec, tp_group=tp_group, validate=validate, impl=impl)
    if isinstance(teacher, HiddenTeacher) and teacher_vocab_end is None:
        teacher_vocab_end = teacher.vocab_size
    name = engine or engine_name(hidden, impl)
    if name is None:
        if impl not in ("auto", "reference"):
            raise ValueError(f"impl: {impl!r} was requested but the fused LM-head kernels take "
                             f"{COVERED_DTYPES}, got {hidden.dtype}")
        loss = materialised_linear_kd_loss(hidden, weight, teacher, vocab_end=vocab_end,
                                           teacher_vocab_end=teacher_vocab_end, tp_group=tp_group,
                                           **validation.kd_kwargs(spec))
        return loss, None

    operands, ends = _kernel_operands(weight, teacher, spec, tp_group, vocab_end, teacher_vocab_end)
    out = fused_linear_kd_loss(hidden, weight, *operands, spec=spec, tp_group=tp_group, backend=name,
                               return_stats=True, **ends)
    loss, teacher_mass, student_mass, lse, top1 = out
    return loss, LinearKDStats(teacher_mass, student_mass, lse, top1)


def _check_row_weights(row_weights, hidden: torch.Tensor, validate: bool) -> None:
    check_row_weights(row_weights, hidden)   # shape, dtype, device: the kernel entry's own check
    if validate and not torch.isfinite(row_weights).all():
        raise ValueError("row_weights: expected finite values (d scalar / d loss per token), "
                         "found inf or NaN")


def linear_kd_loss_weighted(hidden: torch.Tensor, weight: torch.Tensor, teacher, row_weights: torch.Tensor, *,
                            divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                            support: str | None = None, k: int | None = None, mass: str = "renorm",
                            coverage_coef: float = 0.0, tp_group=None, impl: str = "auto",
                            validate: bool = True, vocab_end: int | None = None,
                            teacher_vocab_end: int | None = None, chunk_rows: int | None = None,
                            chunk_bytes: int | None = None):
    """`(scalar, per-token loss [N] detached, LinearKDStats | None)`, scalar = sum_n row_weights[n] loss[n]
    (float32; float64 on the reference path), differentiable w.r.t. `hidden` and `weight`.

    `row_weights [N]`: d scalar / d loss_n, constants (e.g. `aggregation.aggregate_row_weights`); a row
    of weight 0 adds nothing even if its loss is not finite. Other keywords as `linear_kd_loss_with_stats`;
    `impl` also picks the logits kernels of the chunks ("auto": Triton where usable, else the C++ twin
    on CPU when built, else torch). `chunk_rows` / `chunk_bytes`: rows per chunk, or the budget of
    the chunk's logits buffers (defaults: `opkd_kernels.linear_kd_rows`); the same on every TP rank.
    The gradients are computed in the forward and handed out by one backward."""
    spec = validation.objective_spec(divergence=divergence, beta=beta, temperature=temperature,
                                     support=support, k=k, mass=mass, coverage_coef=coverage_coef)
    _check(hidden, weight, teacher, spec, tp_group=tp_group, validate=validate, impl=impl)
    _check_row_weights(row_weights, hidden, validate)
    if isinstance(teacher, HiddenTeacher) and teacher_vocab_end is None:
        teacher_vocab_end = teacher.vocab_size
    name = engine_name(hidden, impl)
    if name is None:   # float64 or impl="reference": materialised logits, autograd as usual
        loss, _ = linear_kd_loss_with_stats(hidden, weight, teacher, **validation.kd_kwargs(spec),
                                            tp_group=tp_group, impl=impl, validate=False, vocab_end=vocab_end,
                                            teacher_vocab_end=teacher_vocab_end)
        c = row_weights.detach().to(loss.dtype)
        return torch.where(c != 0, c * loss, torch.zeros_like(loss)).sum(), loss.detach(), None

    operands, ends = _kernel_operands(weight, teacher, spec, tp_group, vocab_end, teacher_vocab_end)
    scalar, loss, teacher_mass, student_mass, lse, top1 = rows_linear_kd_loss(
        hidden, weight, *operands, row_weights=row_weights, spec=spec, tp_group=tp_group, backend=name,
        chunk_rows=chunk_rows, chunk_bytes=chunk_bytes, **ends)
    return scalar, loss, LinearKDStats(teacher_mass, student_mass, lse, top1)
