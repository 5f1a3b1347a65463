"""Fused LM head + distillation loss over a TP-sharded output layer: the autograd Function.

Inputs: student hidden states `h [N, H]`, this rank's output-weight shard `W [V, H]` (rank r holds
vocabulary rows [r V, (r+1) V)), and the teacher as top-k ids + logprobs, or as its hidden states
`h_t [N, H_t]` + output-weight shard `W_t [V, H_t]` (exact dense KD). Logits z = h W^T / T and
u = h_t W_t^T / T exist only block by block (Triton: tiles on chip; the torch twin: bounded
[rows, cols] blocks). The objective and its collectives are those of `fused_kd.py`, reused:

    forward:   engine.row_stats (pass 1 over the vocabulary)   -> shard stats [N, 6]
               reduce_stats: MAX + SUM all-reduce               -> lse, a/l_u, b/l_s
               dense:  dense_loss (JSD: engine.jsd_sums, a 2nd pass, + SUM all-reduce)
               sparse: support ids (given, or block top-k + all-gather), s_S = h . W[ids] (and the
                       teacher's u_S) + SUM all-reduce, sparse_objective_split on [N, K]
    backward:  one more pass over the vocabulary: per block, dZ = d loss / d logits (the logits
               kernels' formulas), support entries scattered in, padding columns zeroed, then
               dh += dZ W[cols] (float32 accumulator) and dW[cols] = dZ^T h.

Gradient of h: this rank's partial sum over its vocabulary shard, exactly what autograd through
`h @ W.T` would give; the caller's TP region (Megatron's copy-to / gather-from-sequence-parallel
region, whose backward all-reduces or reduce-scatters) sums it over the group, as Megatron's
ColumnParallelLinear does. The loss is identical on every rank.

Cost: the backward recomputes the logits (the price of not keeping [N, V]): the student GEMM runs
3 times + the 2 gradient GEMMs (dense teacher: its GEMM twice; JSD one more pass each).
No `.item()` or other host sync.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from .fused_kd import (
    KdSpec,
    all_reduce,
    dense_loss,
    local_support_ids,
    reduce_stats,
    sparse_objective_split,
    topk_over_group,
    tp_rank,
    union_ids,
)
from .linear_kd_common import LinearInputs, addmm_f32_, row_blocks
from .sparse_objective import effective_divergence

DIV_CODES = {"forward_kl": 1, "reverse_kl": 2, "jsd": 3}
COVERED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Forward calls per engine name ("triton", "chunked-cpp", "chunked-torch").
LAUNCHES: Counter = Counter()


def _support_ids(engine, inp: LinearInputs, ids, spec: KdSpec, offset: int, group):
    if ids is not None:
        return ids

    def top(x, w, end):
        vals, local = engine.topk(x, w, spec.k, end)
        return topk_over_group(vals, local + offset, spec.k, group)

    teacher_top = top(inp.teacher_hidden, inp.teacher_weight, inp.teacher_end)
    if spec.support == "union":
        return union_ids(teacher_top, top(inp.hidden, inp.weight, inp.student_end))
    return teacher_top


def global_argmax(m_local, local_argmax, offset: int, group):
    """Global id of each row's teacher maximum from the shard maxima `m_local [N]` float32 and their
    shard-local columns (ties: the highest id)."""
    m_local = m_local.contiguous()
    m_global = all_reduce(m_local.clone(), dist.ReduceOp.MAX, group)
    ids = torch.where(m_local == m_global, local_argmax + offset, -1)
    return all_reduce(ids, dist.ReduceOp.MAX, group)


def grad_pass(engine, inp: LinearInputs, lse, coef, inv_t: float, beta: float, code: int,
              sparse, need_h: bool, need_w: bool):
    """(d loss / d h [N, H] or None, d loss / d W [V, H] or None), one block of dZ at a time.

    Vocabulary blocks outside, row blocks inside: a block's dW rows are final after its row blocks
    (no [V, H] float32 accumulator); dh accumulates over vocabulary blocks in float32 [N, H]."""
    h, w = inp.hidden, inp.weight
    n, v = inp.num_rows, inp.vocab
    block_rows, block_cols = engine.grad_shape(n, v)
    d_h = torch.zeros(n, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None
    d_w = torch.empty_like(w) if need_w else None   # every vocabulary block writes its rows
    for cols in row_blocks(v, block_cols):
        row_list = row_blocks(n, block_rows)
        acc = None
        for rows in row_list:
            lse_r, coef_r = lse[rows].contiguous(), coef[rows].contiguous()
            dz = engine.grad_block(inp, rows, cols, lse_r, coef_r, inv_t, beta, code)
            if sparse is not None:
                local, s_S, d_S = sparse
                engine.scatter(dz, (local[rows] - cols.start).contiguous(), s_S[rows].contiguous(),
                               d_S[rows].contiguous(), lse_r, coef_r)
            if inp.student_end < cols.stop:   # padding columns are constants, not functions of W
                dz[:, max(inp.student_end - cols.start, 0):] = 0
            if dz.is_cuda and dz.dtype != w.dtype:
                # float32 block (chunked engine): round the finished gradient once, as an unfused
                # bf16 logits buffer holds it, so dh and dW run as half GEMMs on tensor cores
                dz = dz.to(w.dtype)
            if need_h:
                addmm_f32_(d_h[rows], dz, w[cols])
            if need_w:
                if len(row_list) == 1 and dz.is_cuda and dz.dtype == w.dtype:
                    torch.mm(dz.T, h[rows], out=d_w[cols])   # one GEMM over all rows: rounded once
                    continue
                if acc is None:
                    acc = torch.zeros(cols.stop - cols.start, h.shape[1], dtype=torch.float32,
                                      device=h.device)
                addmm_f32_(acc, dz.T, h[rows])
        if acc is not None:
            d_w[cols] = acc
    return (d_h.to(h.dtype) if need_h else None), d_w


class FusedLinearKdLoss(torch.autograd.Function):
    """forward(h, W, h_t | None, W_t | None, ids | None, logprobs | None, spec, engine, group, ends)
    -> (loss [N] f32, teacher mass on S [N], student mass on S [N], lse [N, 2], teacher top-1 [N]);
    only the loss is differentiable, w.r.t. h and W. `ends` = (student_end, teacher_end) columns."""

    @staticmethod
    def forward(ctx, h, w, h_t, w_t, ids, logprobs, spec: KdSpec, engine, group, ends):
        LAUNCHES[engine.name] += 1
        inp = LinearInputs(h, w, h_t, w_t, *ends)
        inv_t = 1.0 / spec.temperature
        kind = effective_divergence(spec.divergence, spec.beta)
        dense_teacher = h_t is not None
        offset = tp_rank(group) * inp.vocab
        stats, argmax = engine.row_stats(inp, inv_t, want_argmax=dense_teacher)
        lse, a_over_lu, b_over_ls = reduce_stats(stats, group)
        top1 = (global_argmax(stats[:, 2], argmax, offset, group) if dense_teacher
                else torch.full_like(lse[:, 0], -1).long())
        ctx.spec, ctx.engine, ctx.ends = spec, engine, ends
        ctx.dense = spec.support is None
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if ctx.dense:
            loss, factor, c1 = dense_loss(kind, spec.beta, lse, a_over_lu, b_over_ls,
                                          lambda: engine.jsd_sums(inp, lse, inv_t, spec.beta), group)
            ctx.code, ctx.factor = DIV_CODES[kind], factor
            ctx.save_for_backward(h, w, h_t, w_t, lse, c1)
            teacher_mass, student_mass = torch.ones_like(loss), torch.ones_like(loss)
        else:
            ids = _support_ids(engine, inp, ids, spec, offset, group)
            local = local_support_ids(ids, offset, inp.vocab)
            s_S = all_reduce(engine.support_values(h, w, local, inp.student_end) * inv_t,
                             dist.ReduceOp.SUM, group)
            valid = ids >= 0
            if dense_teacher:
                u_S = all_reduce(engine.support_values(h_t, w_t, local, inp.teacher_end) * inv_t,
                                 dist.ReduceOp.SUM, group)
                log_p_S = u_S - lse[:, 1:2]
            else:
                log_p_S = logprobs.float()
            loss, d_s, d_lse, teacher_mass, student_mass = sparse_objective_split(
                s_S, lse[:, 0], log_p_S, valid, spec, need_grad, group, engine.sparse_backend)
            ctx.save_for_backward(h, w, local, s_S, d_s, d_lse, lse)
        ctx.mark_non_differentiable(teacher_mass, student_mass, lse, top1)
        return loss, teacher_mass, student_mass, lse, top1

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        spec, engine = ctx.spec, ctx.engine
        inv_t = 1.0 / spec.temperature
        g = grad_loss.float() * inv_t
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.dense:
            h, w, h_t, w_t, lse, c1 = ctx.saved_tensors
            coef = torch.stack([g * ctx.factor, c1], dim=1)
            code, sparse = ctx.code, None
        else:
            h, w, local, s_S, d_s, d_lse, lse = ctx.saved_tensors
            h_t = w_t = None
            coef = torch.stack([g * d_lse, torch.zeros_like(g)], dim=1)
            code, sparse = 0, (local, s_S, d_s * g[:, None])
        inp = LinearInputs(h, w, h_t, w_t, *ctx.ends)
        d_h, d_w = grad_pass(engine, inp, lse, coef, inv_t, spec.beta, code, sparse, need_h, need_w)
        return d_h, d_w, None, None, None, None, None, None, None, None


# ---------------------------------------------------------------- entry point
class LinearKdResult(tuple):
    """`(loss, teacher_mass, student_mass, lse, teacher_top1)`: the per-token loss [N] and, for
    logging, Σ_S p and Σ_S q (1 for the full vocabulary), the global log-partitions [N, 2]
    (student, teacher; NaN where the teacher is) and the teacher's top-1 id [N] (-1 for top-k)."""

    @property
    def loss(self):
        return self[0]


# The chunked engine on a GPU: both [N, C] float32 logits blocks (student, teacher) within this.
CHUNKED_BLOCK_BYTES = 512 << 20


def gpu_chunked_engine(num_rows: int):
    """The chunked engine with the Triton row kernels: every row in one block (dW is one GEMM per
    column block, no accumulator) and as many columns, up to 4096, as fit CHUNKED_BLOCK_BYTES. At
    16384 x 4096 x 151936 it beats the tiles by 15-20% on a dense teacher (one cuBLAS GEMM per
    block instead of matmuls inside the row kernels) and loses on a sparse one (docs/benchmarks.md)."""
    from .linear_kd_chunked import ChunkedLinearKd
    from .triton_backend import TritonKdBackend

    cols = max(512, min(4096, CHUNKED_BLOCK_BYTES // (8 * max(1, num_rows))) // 128 * 128)
    return ChunkedLinearKd(TritonKdBackend(), block_rows=max(1, num_rows), block_cols=cols,
                           gather_elements=1 << 26)


def select_linear_engine(hidden: torch.Tensor, backend="auto"):
    """The engine for `hidden`: "triton" (tiles), "chunked" (the chunked engine with the Triton row
    kernels where they run, else the twin below), "cpp" / "torch" (chunked twin), or "auto" (Triton
    tiles on CUDA, the C++ twin on CPU when built, torch elsewhere); None if the named one cannot
    run here. An engine object passes through (tests and benchmarks pick block sizes that way)."""
    from . import cpu_backend
    from .linear_kd_chunked import ChunkedLinearKd
    from .torch_backend import TorchKdBackend

    if not isinstance(backend, str):
        return backend
    if backend == "chunked":
        from .triton_backend import triton_usable_on

        if hidden.device.type != "cpu" and triton_usable_on(hidden):
            return gpu_chunked_engine(hidden.shape[0])
        backend = "auto"   # off the Triton devices every engine is the chunked twin
    if backend in ("auto", "triton"):
        try:
            from .linear_kd_triton import TritonLinearKd
            from .triton_backend import triton_usable_on
        except ImportError:
            TritonLinearKd = None
        if TritonLinearKd is not None and triton_usable_on(hidden) and (
                backend == "triton" or hidden.device.type != "cpu"):
            return TritonLinearKd()
        if backend == "triton":
            return None
    if backend in ("auto", "cpp") and hidden.device.type == "cpu" and cpu_backend.available():
        return ChunkedLinearKd(cpu_backend.CppKdBackend())
    if backend in ("auto", "torch"):
        return ChunkedLinearKd(TorchKdBackend())
    return None


def shard_ends(v_local: int, student_vocab_end: int | None, teacher_vocab_end: int | None) -> tuple[int, int]:
    """(student, teacher) first padding column of this shard, clamped to [0, V_local] (None: V_local)."""
    return tuple(v_local if end is None else max(0, min(v_local, end))
                 for end in (student_vocab_end, teacher_vocab_end))


def row_major(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def check_linear_inputs(hidden, weight, teacher_hidden, teacher_weight, topk_ids, topk_logprobs, spec):
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in COVERED_DTYPES):
            raise ValueError(f"{name}: expected a 2-D {COVERED_DTYPES} tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected [V_local, H={hidden.shape[1]}], got {tuple(weight.shape)}")
    if (teacher_hidden is None) != (teacher_weight is None):
        raise ValueError("teacher_hidden / teacher_weight: pass both (a dense teacher) or neither")
    if teacher_hidden is not None:
        if teacher_hidden.dim() != 2 or teacher_hidden.shape[0] != hidden.shape[0]:
            raise ValueError(f"teacher_hidden: expected [N={hidden.shape[0]}, H_t], "
                             f"got {tuple(teacher_hidden.shape)}")
        if teacher_weight.shape != (weight.shape[0], teacher_hidden.shape[1]):
            raise ValueError(f"teacher_weight: expected [{weight.shape[0]}, {teacher_hidden.shape[1]}], "
                             f"got {tuple(teacher_weight.shape)}")
        if teacher_hidden.dtype != hidden.dtype or teacher_weight.dtype != hidden.dtype:
            raise ValueError(f"teacher_hidden / teacher_weight: expected dtype {hidden.dtype} (the "
                             f"student's), got {teacher_hidden.dtype} / {teacher_weight.dtype}")
    elif topk_ids is None or topk_logprobs is None:
        raise ValueError("teacher: pass teacher_hidden + teacher_weight, or topk_ids + topk_logprobs")
    elif spec.support is None:
        raise ValueError("spec.support: a top-k teacher needs support='teacher', got None")
    if teacher_hidden is not None and spec.support is not None and topk_ids is None and spec.k is None:
        raise ValueError(f"spec.k: support={spec.support!r} with a dense teacher needs k, got None")


def fused_linear_kd_loss(hidden: torch.Tensor, weight: torch.Tensor,
                         teacher_hidden: torch.Tensor | None = None,
                         teacher_weight: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                         topk_logprobs: torch.Tensor | None = None, *, spec: KdSpec = KdSpec(), tp_group=None,
                         backend="auto", student_vocab_end: int | None = None,
                         teacher_vocab_end: int | None = None, return_stats: bool = False):
    """Per-token distillation loss `[N]` float32 of the logits `hidden @ weight.T`, never materialised.

    `weight` is this rank's `[V_local, H]` shard of the output layer; the teacher is
    `teacher_hidden [N, H_t]` + `teacher_weight [V_local, H_t]` (dense) or `topk_ids` +
    `topk_logprobs [N, K]` (global ids, -1 = padding). `student_vocab_end` / `teacher_vocab_end`:
    shard-local columns at or past it are vocabulary padding (logit -1e4, no gradient); default
    V_local. `backend`: "auto" | "triton" | "cpp" | "torch" or an engine object. Gradients flow to
    `hidden` (this shard's partial sum, see the module docstring) and `weight`. With
    `return_stats`, returns a `LinearKdResult`. Inputs are assumed valid (`kd_loss`-style content
    checks live in opkd_mcore.losses.fused_linear); bad shapes and dtypes raise ValueError.
    """
    check_linear_inputs(hidden, weight, teacher_hidden, teacher_weight, topk_ids, topk_logprobs, spec)
    engine = select_linear_engine(hidden, backend)
    if engine is None:
        raise ValueError(f"backend: {backend!r} cannot run on a {hidden.device.type} tensor here")
    ends = shard_ends(weight.shape[0], student_vocab_end, teacher_vocab_end)
    out = FusedLinearKdLoss.apply(row_major(hidden), row_major(weight), row_major(teacher_hidden),
                                  row_major(teacher_weight), topk_ids, topk_logprobs, spec, engine, tp_group,
                                  ends)
    return LinearKdResult(out) if return_stats else out[0]
