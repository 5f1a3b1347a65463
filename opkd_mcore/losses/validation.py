"""Input checks for `kd_loss`: every failure is a `ValueError` naming the argument.

`objective_spec`, `check_options` and `check_shapes` look only at Python values and tensor
metadata (no host sync). `check_values` reads tensor contents (NaN, id range, duplicate ids): it
costs extra passes and one host sync each, which is why `kd_loss(validate=False)` skips it.
`invalid_topk_rows` checks the same contents without a sync: a per-row flag the trainer adds up
over the step and reads once, after the last backward.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from opkd_kernels.fused_kd import KdSpec
from opkd_mcore.losses.divergences import DIVERGENCES
from opkd_mcore.losses.support_kd import MASSES
from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, TopKTeacher

SUPPORTS = (None, "teacher", "union")
IMPLS = ("auto", "reference", "fused", "triton", "cpp")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


def objective_spec(*, divergence, beta, temperature, support, k, mass, coverage_coef) -> KdSpec:
    """`kd_loss`'s seven objective keywords, checked and packed once as the kernels' `KdSpec` (numbers
    as floats): every layer below an entry point takes the spec, not the keywords."""
    _choice("divergence", divergence, DIVERGENCES)
    _choice("support", support, SUPPORTS)
    _choice("mass", mass, MASSES)
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta: expected a number in [0, 1], got {beta!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    if not (isinstance(coverage_coef, (int, float)) and math.isfinite(coverage_coef) and coverage_coef >= 0):
        raise ValueError(f"coverage_coef: expected a finite number >= 0, got {coverage_coef!r}")
    if mass == "raw" and divergence != "forward_kl":
        raise ValueError(f"mass: expected 'renorm' or 'tail' with divergence={divergence!r}; "
                         "'raw' is defined for divergence='forward_kl' only")
    if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"k: expected a positive int or None, got {k!r}")
    return KdSpec(divergence=divergence, beta=float(beta), temperature=float(temperature), support=support,
                  k=k, mass=mass, coverage_coef=float(coverage_coef))


def kd_kwargs(spec: KdSpec) -> dict:
    """The spec as `kd_loss` keywords (divergence, beta, temperature, support, k, mass, coverage_coef)."""
    return dataclasses.asdict(spec)


def check_options(teacher, spec: KdSpec, *, impl) -> None:
    """What the contract rejects for this teacher and `impl` (the objective itself: `objective_spec`)."""
    if not isinstance(teacher, (DenseTeacher, TopKTeacher)):
        raise ValueError(f"teacher: expected DenseTeacher or TopKTeacher, got {type(teacher).__name__}")
    _choice("impl", impl, IMPLS)
    if isinstance(teacher, TopKTeacher):
        if spec.support is None:
            raise ValueError("support: expected 'teacher' with a TopKTeacher, got None (the exact "
                             "full-vocabulary divergence needs a DenseTeacher)")
        if spec.support == "union":
            raise ValueError("support: expected 'teacher' with a TopKTeacher, got 'union' (it needs teacher "
                             "values on the student's top-k ids, so it is defined for a DenseTeacher only)")
    elif spec.support is not None and spec.k is None:
        raise ValueError(f"k: expected an int >= 1 (the top-k size) with support={spec.support!r} and a "
                         "DenseTeacher, got None")


def check_shapes(student_logits: torch.Tensor, teacher, *, k, tp_size: int) -> None:
    """Tensor ranks, shapes and dtypes (metadata only, no host sync)."""
    if not (isinstance(student_logits, torch.Tensor) and student_logits.dim() == 2
            and student_logits.is_floating_point()):
        raise ValueError("student_logits: expected a floating tensor [N, V_local], got "
                         f"{_describe(student_logits)}")
    n, v_local = student_logits.shape
    vocab = v_local * tp_size
    if isinstance(teacher, DenseTeacher):
        logits = teacher.logits
        if not (isinstance(logits, torch.Tensor) and logits.is_floating_point()
                and tuple(logits.shape) == (n, v_local)):
            raise ValueError(f"teacher.logits: expected a floating tensor of shape {(n, v_local)} "
                             f"(the same as student_logits), got {_describe(logits)}")
        if k is not None and k > vocab:
            raise ValueError(f"k: expected at most the vocabulary size {vocab}, got {k}")
        return
    ids, logprobs = teacher.ids, teacher.logprobs
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == n
            and not ids.is_floating_point() and ids.dtype != torch.bool):
        raise ValueError(f"teacher.ids: expected an integer tensor [N={n}, K], got {_describe(ids)}")
    if not (isinstance(logprobs, torch.Tensor) and logprobs.is_floating_point()
            and logprobs.shape == ids.shape):
        raise ValueError(f"teacher.logprobs: expected a floating tensor of shape {tuple(ids.shape)} "
                         f"(the same as teacher.ids), got {_describe(logprobs)}")
    if k is not None and k > ids.shape[1]:
        raise ValueError(f"k: expected at most the teacher's top-k width K={ids.shape[1]}, got {k}")


def check_values(teacher, *, vocab: int) -> None:
    """Tensor contents: NaN teacher values, ids outside [0, V), duplicate ids in a row (host syncs)."""
    if isinstance(teacher, DenseTeacher):
        if torch.isnan(teacher.logits).any():
            row = _first_bad_row(torch.isnan(teacher.logits))
            raise ValueError(f"teacher.logits: expected no NaN, found one in row {row}")
        return
    ids = teacher.ids
    bad_range, nan, dup = _topk_faults(teacher, vocab)
    if bad_range.any():
        row = _first_bad_row(bad_range)
        raise ValueError(f"teacher.ids: expected ids in [0, V={vocab}) or {PAD_ID} for padding, "
                         f"row {row} has {ids[row][bad_range[row]].tolist()}")
    if nan.any():
        row = _first_bad_row(nan)
        raise ValueError(f"teacher.logprobs: expected no NaN, found one in row {row}")
    if dup.any():
        row = _first_bad_row(dup)
        raise ValueError(f"teacher.ids: expected distinct ids in a row, row {row} has duplicates: "
                         f"{ids[row].tolist()}")


def invalid_topk_rows(teacher: TopKTeacher, *, vocab: int) -> torch.Tensor:
    """`[N]` float, 1 for a row `check_values` would reject (an id outside [0, V) other than the
    padding, a NaN logprob, an id twice), else 0: tensor ops on the rows' device, no host sync."""
    return torch.stack([m.any(1) for m in _topk_faults(teacher, vocab)]).any(0).float()


def _topk_faults(teacher: TopKTeacher, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of what top-k rows must not hold: ids outside [0, V) other than the padding `[N, K]`,
    NaN logprobs `[N, K]`, an id equal to the next one in the row's sorted order `[N, K-1]`."""
    ids, logprobs = teacher.ids, teacher.logprobs
    valid = ids != PAD_ID
    bad_range = valid & ((ids < 0) | (ids >= vocab))
    # padding slots get distinct negative stand-ins, so only real ids can repeat
    sorted_ids = torch.sort(torch.where(valid, ids, -1 - torch.arange(ids.shape[1], device=ids.device)),
                            dim=1).values
    return bad_range, torch.isnan(logprobs), sorted_ids[:, 1:] == sorted_ids[:, :-1]


def _first_bad_row(mask) -> int:
    return int(mask.reshape(mask.shape[0], -1).any(dim=1).nonzero()[0, 0])


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
