"""`kd_loss`: the vocab-parallel distillation loss (contract in DESIGN.md, formulas in losses.md).

Dispatch: after validation, `impl="auto"` uses `opkd_mcore.losses.fused.fused_kd_loss_or_none` when
that module exists and covers the configuration/device, else the reference path below;
`impl="reference"` always takes the reference path; `impl="fused"` fails if no fused path applies,
and `"triton"` / `"cpp"` force that backend (failing likewise).

The reference path is two autograd Functions over the sharded vocabulary: `FullVocabKD`
(`support=None`) and `SupportKD` (sparse support). Neither syncs with the host; `validate=True`
adds content checks (NaN, id range, duplicates) that do.

Shape legend: N tokens, V_local vocab entries on this rank, K teacher top-k width, C support ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from opkd_kernels.fused_kd import KdSpec
from opkd_mcore.losses import validation
from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.full_vocab import compute_dtype, full_vocab_kd
from opkd_mcore.losses.fused import fused_kd_loss_or_none
from opkd_mcore.losses.support_kd import SupportKD, select_support
from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, TopKTeacher


@dataclass(frozen=True)
class KDStats:
    """Per-token by-products of the loss, as tensors (no host sync), for `kd_metrics`.

    teacher_mass: Σ_S p (1 for support=None; 0 on all-padding rows).
    student_mass: Σ_S q (1 for support=None; 0 on all-padding rows).
    topk_overlap: |top-k(p) ∩ top-k(q)| / |top-k(p)| (None when no k is known, i.e. support=None
        without `overlap_k`). For a TopKTeacher, top-k(p) is its valid ids.
    """

    teacher_mass: torch.Tensor
    student_mass: torch.Tensor
    topk_overlap: torch.Tensor | None


def kd_loss(student_logits: torch.Tensor, teacher: DenseTeacher | TopKTeacher, *,
            divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
            support: str | None = None, k: int | None = None, mass: str = "renorm",
            coverage_coef: float = 0.0, tp_group=None, impl: str = "auto",
            validate: bool = True, token_chunk: int | None = None) -> torch.Tensor:
    """Per-token distillation loss `[N]` (float32; float64 for float64 logits), same on every TP rank.

    Args (see DESIGN.md "The distillation loss"):
        student_logits: `[N, V_local]`, this rank's contiguous vocabulary shard.
        teacher: `DenseTeacher` (logits sharded like the student) or `TopKTeacher` (global ids, -1 pad).
        divergence: "forward_kl" | "reverse_kl" | "jsd" (beta = 0 / 1 give forward / reverse KL).
        temperature: student logits (and dense teacher logits) are divided by it; top-k logprobs are not.
        support: None (exact, dense only) | "teacher" | "union" (dense only); `k` sizes the top-k.
        mass: "renorm" | "tail" | "raw" (forward KL only) on a sparse support.
        coverage_coef: weight of TCAD's coverage term -log Σ_S q.
        tp_group: the tensor-parallel process group the vocabulary is sharded over (None = TP 1).
        impl: "auto" | "reference" | "fused" | "triton" | "cpp".
        validate: also check tensor contents (host syncs); options and shapes are always checked.
        token_chunk: reference path only: process this many tokens at a time, so the temporaries
            are O(token_chunk * V_local) instead of O(N * V_local) (long responses); each chunk
            costs its own collectives. Every rank of the TP group must pass the same value.
    """
    loss, _ = _kd_loss(student_logits, teacher, divergence=divergence, beta=beta, temperature=temperature,
                       support=support, k=k, mass=mass, coverage_coef=coverage_coef, tp_group=tp_group,
                       impl=impl, validate=validate, token_chunk=token_chunk, with_stats=False,
                       overlap_k=None)
    return loss


def kd_loss_with_stats(student_logits, teacher, *, overlap_k: int | None = None, **kwargs
                       ) -> tuple[torch.Tensor, KDStats]:
    """`kd_loss` (same keywords and dispatch), plus `KDStats` for logging.

    The masses come from the loss's own support tensors (fused kernels included: no extra pass
    over the vocabulary). `overlap_k` sizes the top-k overlap metric (default: `k`, or the
    teacher's K); it costs one sharded top-k of the student logits in their own dtype.
    """
    return _kd_loss(student_logits, teacher, with_stats=True, overlap_k=overlap_k, **kwargs)


def _kd_loss(student_logits, teacher, *, divergence="forward_kl", beta=0.5, temperature=1.0, support=None,
             k=None, mass="renorm", coverage_coef=0.0, tp_group=None, impl="auto", validate=True,
             token_chunk=None, with_stats=False, overlap_k=None):
    spec = validation.objective_spec(divergence=divergence, beta=beta, temperature=temperature,
                                     support=support, k=k, mass=mass, coverage_coef=coverage_coef)
    validation.check_options(teacher, spec, impl=impl)
    if token_chunk is not None and not (isinstance(token_chunk, int) and token_chunk >= 1):
        raise ValueError(f"token_chunk: expected a positive int or None, got {token_chunk!r}")
    tp_size = vp.group_size(tp_group)
    validation.check_shapes(student_logits, teacher, k=k, tp_size=tp_size)
    if validate:
        validation.check_values(teacher, vocab=student_logits.shape[1] * tp_size)
    if impl != "reference":
        fused = fused_kd_loss_or_none(student_logits, teacher, tp_group=tp_group, return_masses=True,
                                      backend="auto" if impl == "fused" else impl,
                                      **validation.kd_kwargs(spec))
        if fused is not None:
            loss, teacher_mass, student_mass, ids = fused
            if not with_stats:
                return loss, None
            k_overlap = overlap_k or spec.k
            overlap = _fused_overlap(student_logits, teacher, ids, spec.support, k_overlap, tp_group)
            return loss, KDStats(teacher_mass, student_mass, overlap)
        if impl != "auto":
            raise ValueError(f"impl: {impl!r} was requested but no fused kernel covers this "
                             f"configuration/device ({divergence=}, {support=}, {mass=}, "
                             f"dtype={student_logits.dtype}, device={student_logits.device.type})")
    if token_chunk is None or student_logits.shape[0] <= token_chunk:
        return _reference_path(student_logits, teacher, spec, tp_group, with_stats, overlap_k)
    chunks = zip(torch.split(student_logits, token_chunk), _split_rows(teacher, token_chunk))
    pieces = [_reference_path(logits, part, spec, tp_group, with_stats, overlap_k) for logits, part in chunks]
    loss = torch.cat([piece[0] for piece in pieces])
    if not with_stats:
        return loss, None
    overlaps = [piece[1].topk_overlap for piece in pieces]
    return loss, KDStats(torch.cat([piece[1].teacher_mass for piece in pieces]),
                         torch.cat([piece[1].student_mass for piece in pieces]),
                         None if overlaps[0] is None else torch.cat(overlaps))


def _split_rows(teacher, chunk: int):
    if isinstance(teacher, DenseTeacher):
        return [DenseTeacher(rows) for rows in torch.split(teacher.logits, chunk)]
    return [TopKTeacher(ids, lps) for ids, lps in zip(torch.split(teacher.ids, chunk),
                                                       torch.split(teacher.logprobs, chunk))]


def _reference_path(student_logits, teacher, spec: KdSpec, tp_group, with_stats, overlap_k):
    """The autograd Functions of this package: `(loss [N], KDStats or None)`."""
    if spec.support is None:
        loss = full_vocab_kd(student_logits, teacher.logits, temperature=spec.temperature,
                             divergence=spec.divergence, beta=spec.beta, group=tp_group)
        if not with_stats:
            return loss, None
        return loss, _full_vocab_stats(student_logits, teacher, overlap_k or spec.k, tp_group)
    ids, logprobs, student_topk = select_support(student_logits, teacher, support=spec.support, k=spec.k,
                                                 group=tp_group)
    dense_logits = teacher.logits.detach() if isinstance(teacher, DenseTeacher) else None
    loss, teacher_mass, student_mass = SupportKD.apply(
        student_logits, dense_logits, ids, logprobs, spec.temperature, spec.divergence, spec.beta, spec.mass,
        spec.coverage_coef, tp_group)
    if not with_stats:
        return loss, None
    overlap = _overlap(student_logits, teacher, ids, student_topk, spec.support, overlap_k, tp_group)
    return loss, KDStats(teacher_mass, student_mass, overlap)


@torch.no_grad()
def _fused_overlap(student_logits, teacher, support_ids, support, overlap_k, group):
    """Top-k overlap for the fused path (None when no k is known for a full-vocabulary loss)."""
    if support is not None:
        return _overlap(student_logits, teacher, support_ids, None, support, overlap_k, group)
    if overlap_k is None:
        return None
    return topk_overlap(vp.sharded_topk(teacher.logits.detach(), overlap_k, group),
                        vp.sharded_topk(student_logits.detach(), overlap_k, group))


@torch.no_grad()
def _overlap(student_logits, teacher, support_ids, student_topk, support, overlap_k, group):
    if isinstance(teacher, TopKTeacher):
        teacher_ids = support_ids
    else:
        k_used = support_ids.shape[1] // (2 if support == "union" else 1)
        teacher_ids = support_ids[:, :k_used]
    k_overlap = overlap_k or teacher_ids.shape[1]
    if student_topk is None or student_topk.shape[1] != k_overlap:
        student_topk = vp.sharded_topk(student_logits.detach(), k_overlap, group)
    return topk_overlap(teacher_ids, student_topk)


def topk_overlap(teacher_ids_NK: torch.Tensor, student_ids_NK: torch.Tensor) -> torch.Tensor:
    """Fraction of the teacher's valid ids that are among the student's ids, per row (0 if none)."""
    valid = teacher_ids_NK != PAD_ID
    hit = (teacher_ids_NK[:, :, None] == student_ids_NK[:, None, :]).any(dim=2) & valid
    return hit.sum(dim=1) / valid.sum(dim=1).clamp(min=1)


@torch.no_grad()
def _full_vocab_stats(student_logits, teacher, overlap_k, group) -> KDStats:
    ones = torch.ones(student_logits.shape[0], dtype=compute_dtype(student_logits.dtype),
                      device=student_logits.device)
    overlap = None
    if overlap_k is not None:
        overlap = topk_overlap(vp.sharded_topk(teacher.logits, overlap_k, group),
                               vp.sharded_topk(student_logits.detach(), overlap_k, group))
    return KDStats(ones, ones.clone(), overlap)
