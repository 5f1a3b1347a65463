"""Fused distillation loss over a TP-sharded vocabulary: the autograd Function and its entry point.

The kernels (Triton on CUDA, the C++ twin on CPU) do the per-row passes over `[N, V_local]`;
this file slots the TP collectives between them, as Megatron's vocab-parallel cross entropy does:

    forward:  row stats (1 pass)  -> MAX + SUM all-reduce of [N, 2] / [N, 4]
              JSD only: 2nd pass -> SUM all-reduce of [N, 2]
              sparse support: gather s_S (and the dense teacher's u_S) at the K ids -> SUM all-reduce,
              then the objective on [N, K] tensors (Triton: one launch per rank; torch path:
              1/TP of the rows per rank -> all-gather of [N/TP, K+2])
    backward: one pass writing d loss / d logits, in place into the logits buffer when allowed,
              then (sparse support) a masked store of the K support entries.

Extra memory is O(N) floats dense and O(N K) sparse: no [N, V] temporary in either direction.
No `.item()` or other host sync: every per-row constant stays on the device.
The collectives and the objective assembly (stats merge/reduce, dense loss, sparse objective,
support ids) are module functions, shared with the fused LM-head loss (`fused_linear_kd.py`).
The forward also yields the row statistics a trainer logs (teacher and student mass on the
support) from the same [N, K] tensors, so logging never needs a second pass over the vocabulary.
Shape legend: N tokens, V_local vocab entries on this rank, K support ids per token.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sparse_objective import effective_divergence, sparse_objective_and_grads

DIV_CODES = {"forward_kl": 1, "reverse_kl": 2, "jsd": 3}
COVERED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Forward calls per backend name ("triton", "cpp"): lets a trainer (and its tests) prove which
# kernels ran inside a real step, without timing or profiling.
LAUNCHES: Counter = Counter()


@dataclass(frozen=True)
class KdSpec:
    """The objective, with the same meaning as `kd_loss`'s keywords (see DESIGN.md)."""

    divergence: str = "forward_kl"   # forward_kl | reverse_kl | jsd
    beta: float = 0.5                # JSD mixture weight; 0 / 1 = unscaled forward / reverse KL
    temperature: float = 1.0         # student (and dense teacher) logits are divided by it
    support: str | None = None       # None (full vocab, dense) | "teacher" | "union" (dense)
    k: int | None = None             # support size for a dense teacher
    mass: str = "renorm"             # renorm | tail | raw, on a sparse support
    coverage_coef: float = 0.0       # weight of -log(student mass on S)


# The maxima of the row stats (m_s, m_u) as a strided slice: a Python list index would build a host
# tensor and copy it to the device, which blocks the host until the stats kernel has finished.
_MAX_COLUMNS = slice(0, 3, 2)


# ---------------------------------------------------------------- TP collectives (explicit group)
def tp_size(group) -> int:
    # group None means "no tensor parallelism", not the default (world) group
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def tp_rank(group) -> int:
    return dist.get_rank(group) if tp_size(group) > 1 else 0


def all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if tp_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def merge_stats(parts_SN6: torch.Tensor) -> torch.Tensor:
    """Row stats of S disjoint vocabulary pieces `[S, N, 6]` -> the stats of their union `[N, 6]`.

    The same rescaling as the TP reduce below, done locally (a fused LM head computes the stats of
    vocabulary blocks, never of the whole shard at once): m = max_i m_i, l = sum_i l_i e^(m_i - m),
    a (teacher-weighted) rescales with the teacher max, b (student-weighted) with the student max."""
    if parts_SN6.shape[0] == 1:
        return parts_SN6[0]
    maxima = parts_SN6[:, :, _MAX_COLUMNS]                                      # [S, N, 2]
    m = maxima.amax(dim=0)                                                      # [N, 2]
    scale = torch.exp(maxima - m)                                               # [S, N, 2]
    out = torch.empty_like(parts_SN6[0])
    out[:, _MAX_COLUMNS] = m
    out[:, 1] = (parts_SN6[:, :, 1] * scale[:, :, 0]).sum(dim=0)
    out[:, 3] = (parts_SN6[:, :, 3] * scale[:, :, 1]).sum(dim=0)
    out[:, 4] = (parts_SN6[:, :, 4] * scale[:, :, 1]).sum(dim=0)
    out[:, 5] = (parts_SN6[:, :, 5] * scale[:, :, 0]).sum(dim=0)
    return out


def reduce_stats(stats: torch.Tensor, group):
    """Shard stats (m_s, l_s, m_u, l_u, a, b) -> global (lse [N, 2], a / l_u, b / l_s)."""
    m_local = stats[:, _MAX_COLUMNS].contiguous()
    m_global = all_reduce(m_local.clone(), dist.ReduceOp.MAX, group)
    scale = torch.exp(m_local - m_global)
    sums = torch.stack([stats[:, 1] * scale[:, 0], stats[:, 3] * scale[:, 1],
                        stats[:, 4] * scale[:, 1], stats[:, 5] * scale[:, 0]], dim=1)
    sums = all_reduce(sums, dist.ReduceOp.SUM, group)
    lse = m_global + torch.log(sums[:, :2])
    return lse.contiguous(), sums[:, 2] / sums[:, 1], sums[:, 3] / sums[:, 0]


def _sharded_topk_ids(x_NV: torch.Tensor, k: int, offset: int, group) -> torch.Tensor:
    """Global ids `[N, k]` of the row-wise top-k over all shards (local top-k, all-gather, top-k)."""
    # top-k in the logits' own dtype: a float32 copy would be an [N, V] temporary
    vals, idx = x_NV.topk(min(k, x_NV.shape[1]), dim=1)
    return topk_over_group(vals.float(), idx + offset, k, group)


def topk_over_group(vals_NC: torch.Tensor, ids_NC: torch.Tensor, k: int, group) -> torch.Tensor:
    """Global ids `[N, k]` of the top-k among every rank's candidates (values float32, global ids)."""
    world = tp_size(group)
    if world > 1:
        all_vals = [torch.empty_like(vals_NC) for _ in range(world)]
        all_idx = [torch.empty_like(ids_NC) for _ in range(world)]
        dist.all_gather(all_vals, vals_NC.contiguous(), group=group)
        dist.all_gather(all_idx, ids_NC.contiguous(), group=group)
        vals_NC, ids_NC = torch.cat(all_vals, dim=1), torch.cat(all_idx, dim=1)
    top = vals_NC.topk(min(k, vals_NC.shape[1]), dim=1).indices
    return ids_NC.gather(1, top)


def union_ids(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """Row-wise set union, duplicates turned into padding (-1)."""
    ids = torch.cat([a_NK, b_NK], dim=1).sort(dim=1).values
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return ids.masked_fill(dup, -1)


def support_values(x_NV: torch.Tensor, ids_NK: torch.Tensor, offset: int, inv_t: float,
                   with_local: bool = True):
    """(x / T at the global support ids that are on this shard, float32 `[N, K]`, 0 elsewhere;
    shard-local ids `[N, K]`, -1 elsewhere, or None). The torch version of a backend's
    `support_gather` (Triton: one launch); the SUM all-reduce over TP makes the values replicated."""
    local = local_support_ids(ids_NK, offset, x_NV.shape[1])
    idx = local.clamp(0, x_NV.shape[1] - 1)
    vals = torch.where(local >= 0, x_NV.gather(1, idx).float() * inv_t, 0.0)
    return vals, (local if with_local else None)


# ------------------------------------- objective assembly (shared with fused_linear_kd.py)
def dense_loss(kind, beta, lse, a_over_lu, b_over_ls, local_jsd_sums, group):
    """Full-vocabulary loss [N] and the per-row constants (factor, c1) of its gradient.

    `local_jsd_sums()` gives this shard's [N, 2] JSD sums (a second pass; called for JSD only)."""
    lse_s, lse_u = lse[:, 0], lse[:, 1]
    if kind == "forward_kl":
        return a_over_lu - lse_u + lse_s, 1.0, torch.zeros_like(lse_s)
    if kind == "reverse_kl":
        loss = b_over_ls - lse_s + lse_u
        return loss, 1.0, loss
    sums = all_reduce(local_jsd_sums(), dist.ReduceOp.SUM, group)
    return sums[:, 0].contiguous(), 1.0 - beta, sums[:, 1].contiguous()


def local_support_ids(ids_NK: torch.Tensor, offset: int, v_local: int) -> torch.Tensor:
    """Global support ids -> shard-local column ids, -1 where the id is padding or on another shard."""
    local = ids_NK - offset
    return torch.where((ids_NK >= 0) & (local >= 0) & (local < v_local), local, -1)


def sparse_objective_split(s_S, lse_s, log_p_S, valid, spec, need_grad, group, backend=None):
    """The objective on TP-replicated [N, K] inputs -> replicated (loss, dL/ds_S, dL/dlse, teacher
    mass on S, student mass on S).

    A backend with its own `sparse_objective` (Triton: one launch, ~0.1 ms for N=16384, K=256,
    masses included) runs it on every rank. The torch version (C++ / NPU backends) is ~30 launches
    of float64 ops with autograd: there each rank does 1/TP of the rows and one all-gather of (loss,
    dL/dlse, dL/ds_S) makes the result replicated again, so that work and its temporaries shrink
    with TP; the masses are computed on every rank, from the replicated inputs."""
    world = tp_size(group)
    args = (spec.divergence, spec.beta, spec.mass, spec.coverage_coef)
    fused_objective = getattr(backend, "sparse_objective", None)
    if fused_objective is not None:
        return fused_objective(s_S, lse_s, log_p_S, valid, *args, need_grad=need_grad)
    masses = support_masses(s_S, lse_s, log_p_S, valid)
    if world == 1:
        return *sparse_objective_and_grads(s_S, lse_s, log_p_S, valid, *args, need_grad=need_grad), *masses
    objective = sparse_objective_and_grads
    n, k = s_S.shape
    rows = -(-n // world)
    lo = min(n, tp_rank(group) * rows)
    hi = min(n, lo + rows)
    loss, d_s, d_lse = objective(s_S[lo:hi], lse_s[lo:hi], log_p_S[lo:hi], valid[lo:hi], *args,
                                 need_grad=need_grad)
    packed = s_S.new_zeros(rows, k + 2 if need_grad else 1)
    packed[:hi - lo, 0] = loss
    if need_grad:
        packed[:hi - lo, 1], packed[:hi - lo, 2:] = d_lse, d_s
    parts = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed, group=group)
    full = torch.cat(parts)[:n]
    if not need_grad:
        return full[:, 0].contiguous(), None, None, *masses
    return full[:, 0].contiguous(), full[:, 2:].contiguous(), full[:, 1].contiguous(), *masses


def _support_ids(z, t, ids, spec, offset, group):
    if ids is not None:
        return ids
    teacher_top = _sharded_topk_ids(t, spec.k, offset, group)
    if spec.support == "union":
        return union_ids(teacher_top, _sharded_topk_ids(z, spec.k, offset, group))
    return teacher_top


def support_masses(s_S, lse_s, log_p_S, valid):
    """(Σ_S p, Σ_S q) per row from the [N, K] support tensors; 0 on all-padding rows."""
    zero = torch.zeros_like(s_S)
    teacher = torch.where(valid, torch.exp(log_p_S), zero).sum(dim=1)
    student = torch.where(valid, torch.exp(s_S - lse_s[:, None]), zero).sum(dim=1)
    return teacher, student


# ----------------------- one block of rows: loss, then its gradient (shared with linear_kd_rows.py)
@dataclass(frozen=True)
class KdGradState:
    """What `write_kd_grad` needs besides the logits: O(N) / O(N K) tensors from `kd_objective`.

    Dense: `row_coef` = c1 of `dense_loss`, `code` its divergence, `factor` its gradient scale.
    Sparse support: `row_coef` = dL/dlse, and the support (`local` shard-local ids, `s_S`, dL/ds_S)."""

    lse: torch.Tensor
    row_coef: torch.Tensor
    code: int = 0
    factor: float = 1.0
    local: torch.Tensor | None = None
    s_S: torch.Tensor | None = None
    d_s: torch.Tensor | None = None

    def tensors(self) -> tuple:
        return self.lse, self.row_coef, self.local, self.s_S, self.d_s

    def with_tensors(self, tensors) -> KdGradState:
        """The same state over `tensors` (as `ctx.saved_tensors` hands them back)."""
        lse, row_coef, local, s_S, d_s = tensors
        return KdGradState(lse, row_coef, self.code, self.factor, local, s_S, d_s)


def kd_objective(z, t, ids, logprobs, spec: KdSpec, backend, group, need_grad: bool):
    """The per-token loss of logits `z [N, V_local]` (teacher logits `t` or top-k `ids`/`logprobs`):
    `(loss [N], teacher mass on S [N], student mass on S [N], KdGradState)`. Runs the collectives."""
    inv_t = 1.0 / spec.temperature
    kind = effective_divergence(spec.divergence, spec.beta)
    # one pass gives both log-partitions (a dense teacher's is also needed for log p_S) and the one
    # teacher sum the dense objective reads (each costs ~20% of the pass)
    want = {"forward_kl": "a", "reverse_kl": "b"}.get(kind, "") if spec.support is None else ""
    lse, a_over_lu, b_over_ls = reduce_stats(backend.row_stats(z, t, inv_t, want), group)
    if spec.support is None:
        loss, factor, c1 = dense_loss(kind, spec.beta, lse, a_over_lu, b_over_ls,
                                      lambda: backend.jsd_sums(z, t, lse, inv_t, spec.beta), group)
        ones = torch.ones_like(loss)
        return loss, ones, ones.clone(), KdGradState(lse, c1, DIV_CODES[kind], factor)
    offset = tp_rank(group) * z.shape[1]
    ids = _support_ids(z, t, ids, spec, offset, group)
    gather = getattr(backend, "support_gather", None) or support_values
    s_local, local = gather(z, ids, offset, inv_t, True)
    s_S = all_reduce(s_local, dist.ReduceOp.SUM, group)
    valid = ids >= 0
    if t is not None:
        log_p_S = all_reduce(gather(t, ids, offset, inv_t, False)[0], dist.ReduceOp.SUM, group) - lse[:, 1:2]
    else:
        log_p_S = logprobs.float()
    loss, d_s, d_lse, teacher_mass, student_mass = sparse_objective_split(
        s_S, lse[:, 0], log_p_S, valid, spec, need_grad, group, backend)
    return loss, teacher_mass, student_mass, KdGradState(lse, d_lse, local=local, s_S=s_S, d_s=d_s)


def write_kd_grad(z, t, state: KdGradState, grad_loss, out, spec: KdSpec, backend, teacher_top1=None):
    """`out` = d(sum_n grad_loss[n] loss[n]) / dz (`out` may be `z` itself: written in place).
    `teacher_top1`: (values, columns) [N] for the dense teacher's row maxima, filled in the same pass
    (full-vocabulary objectives, backends with `writes_teacher_top1`)."""
    inv_t = 1.0 / spec.temperature
    g = grad_loss.float() * inv_t
    if state.s_S is None:
        coef = torch.stack([g * state.factor, state.row_coef], dim=1)
        top1 = {} if teacher_top1 is None else {"teacher_top1": teacher_top1}
        return backend.write_grad(z, t, out, state.lse, coef, inv_t, spec.beta, state.code, **top1)
    coef = torch.stack([g * state.row_coef, torch.zeros_like(g)], dim=1)
    backend.write_grad(z, None, out, state.lse, coef, inv_t, spec.beta, 0)
    return backend.sparse_scatter(out, state.local, state.s_S, state.d_s * g[:, None], state.lse, coef)


# ---------------------------------------------------------------- the autograd Function
class FusedKdLoss(torch.autograd.Function):
    """forward(student [N, V_local], teacher [N, V_local] | None, ids [N, K] | None,
    logprobs [N, K] | None, spec, backend, group, inplace_grad)
    -> (loss [N] float32, teacher mass on S [N], student mass on S [N]); only the loss is
    differentiable (masses are 1 for the full-vocabulary objective)."""

    @staticmethod
    def forward(ctx, z, t, ids, logprobs, spec: KdSpec, backend, group, inplace_grad: bool):
        LAUNCHES[backend.name] += 1
        loss, teacher_mass, student_mass, state = kd_objective(z, t, ids, logprobs, spec, backend, group,
                                                               ctx.needs_input_grad[0])
        ctx.spec, ctx.backend, ctx.inplace = spec, backend, inplace_grad
        ctx.state = state.with_tensors([None] * 5)
        # a sparse support's gradient never reads the teacher's logits: they need not outlive the forward
        ctx.save_for_backward(z, t if spec.support is None else None, *state.tensors())
        ctx.mark_non_differentiable(teacher_mass, student_mass)
        return loss, teacher_mass, student_mass

    @staticmethod
    def backward(ctx, grad_loss, _grad_teacher_mass=None, _grad_student_mass=None):
        z, t, *saved = ctx.saved_tensors
        state = ctx.state.with_tensors(saved)
        out = z if ctx.inplace else torch.empty_like(z)
        write_kd_grad(z, t, state, grad_loss, out, ctx.spec, ctx.backend)
        if ctx.inplace:
            # Anything else that saved the logits for its backward must now fail loudly.
            torch.autograd.graph.increment_version(z)
        return out, None, None, None, None, None, None, None


# ---------------------------------------------------------------- entry point
def _row_major(x: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def select_backend(student_logits: torch.Tensor, backend: str = "auto"):
    """The backend object for a tensor: "triton", "cpp", or "auto" (None if nothing covers it)."""
    from . import cpu_backend

    if backend in ("auto", "triton"):
        try:
            from .triton_backend import TritonKdBackend, triton_usable_on
        except ImportError:
            TritonKdBackend = None
        if TritonKdBackend is not None and triton_usable_on(student_logits) and (
                backend == "triton" or student_logits.device.type != "cpu"):
            return TritonKdBackend()
        if backend == "triton":
            return None
    if backend in ("auto", "cpp") and student_logits.device.type == "cpu" and cpu_backend.available():
        return cpu_backend.CppKdBackend()
    return None


def fused_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None,
                  topk_ids: torch.Tensor | None = None, topk_logprobs: torch.Tensor | None = None, *,
                  spec: KdSpec = KdSpec(), tp_group=None, backend="auto",
                  inplace_grad: bool | None = None, return_masses: bool = False):
    """Per-token distillation loss `[N]` float32 through the fused kernels.

    With `return_masses`, returns `(loss, teacher_mass [N], student_mass [N])`: Σ_S p and Σ_S q on
    the support (1 and 1 for the full-vocabulary objective), from the forward's own tensors.

    Either `teacher_logits` (dense, sharded like the student) or `topk_ids` + `topk_logprobs`.
    `backend`: "auto" | "triton" | "cpp" or a backend object. `inplace_grad`: write the gradient
    into the student-logits buffer (default: yes unless the logits are a leaf tensor, i.e. a
    buffer the caller owns rather than a model output). Inputs are assumed valid (`kd_loss`
    validates them); unsupported dtypes raise ValueError.
    """
    if student_logits.dtype not in COVERED_DTYPES:
        raise ValueError(f"student_logits: fused kernels take {COVERED_DTYPES}, got {student_logits.dtype}")
    if teacher_logits is None and (topk_ids is None or topk_logprobs is None):
        raise ValueError("teacher: pass teacher_logits, or topk_ids together with topk_logprobs")
    if teacher_logits is None and spec.support is None:
        raise ValueError("spec.support: a top-k teacher needs support='teacher', got None")
    if teacher_logits is not None and spec.support is not None and topk_ids is None and spec.k is None:
        raise ValueError(f"spec.k: support={spec.support!r} with dense teacher logits needs k, got None")
    impl = select_backend(student_logits, backend) if isinstance(backend, str) else backend
    if impl is None:
        raise ValueError(f"backend: {backend!r} cannot run on a {student_logits.device.type} tensor here")
    if inplace_grad is None:
        inplace_grad = not student_logits.is_leaf
    loss, teacher_mass, student_mass = FusedKdLoss.apply(
        _row_major(student_logits), _row_major(teacher_logits), topk_ids, topk_logprobs, spec, impl,
        tp_group, inplace_grad)
    return (loss, teacher_mass, student_mass) if return_masses else loss
