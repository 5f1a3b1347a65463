"""Fused LM head + distillation loss, "rows" engine: the gradients are computed in the forward.

The scalar a trainer back-propagates is linear in the per-token loss (`aggregate` in opkd_mcore),
so its per-row weights c_n = d scalar / d loss_n are known before the forward. With them every chunk
of R rows (all V columns of this rank's shard at once) is visited once:

    z = h[rows] W^T                 [R, V] in the operands' dtype (one GEMM; padding cols PAD_LOGIT)
    u = h_t[rows] W_t^T             [R, V] the same, dense teacher only
    loss, d(sum_n c_n loss_n)/dz    `fused_kd.kd_objective` + `write_kd_grad`: the logits kernels and
                                    TP all-reduces of `kd_loss`'s fused path, the gradient over z
    dh[rows] = dz W,  dW += dz^T h[rows]

and the chunk is freed. The backward only scales the stored dh, dW by the incoming gradient of the
scalar. GEMM-sized products: student logits, teacher logits, dh, dW: the 4 of materialised logits,
against 6 for the engines that keep nothing and recompute the logits in the backward. JSD costs one
more pass of the row kernels over the chunk, no GEMM.

Memory at once: one chunk's z (and u), R x V in the operands' dtype (R from `CHUNK_BYTES`); the
logits backend's temporaries (O(R) for Triton and the C++ twin, a few float32 R x V for the torch
backend); dh [N, H] and dW [V, H] in the operands' dtype, held from the forward to the backward
(the results any engine returns); a float32 dW accumulator only where `dw_float32` says so; O(N)
per-row statistics. No `.item()` or other host sync.

Gradient of h: this rank's partial sum over its vocabulary shard, as in `fused_linear_kd.py` (the
caller's TP region sums it). Shape legend: N tokens, H / H_t hidden sizes, V = V_local, R chunk rows.
"""
from __future__ import annotations

import torch

from .fused_kd import KdSpec, kd_objective, select_backend, tp_rank, write_kd_grad
from .fused_linear_kd import LAUNCHES, check_linear_inputs, global_argmax, row_major, shard_ends
from .linear_kd_common import LinearInputs, addmm_f32_, logits_block, row_blocks
from .torch_backend import TorchKdBackend

# Live chunk buffers (z, and u for a dense teacher) off CPU: at V = 151936 in bf16, R = 2048 rows
# with a dense teacher (1.16 GiB), 4096 with top-k rows. Big enough that the GEMMs run at full
# rate, small enough to sit beside the activations of a long micro-batch.
CHUNK_BYTES = 5 << 28
# On CPU: the torch backend's float32 temporaries are a few times the chunk; stay cache-sized.
CPU_CHUNK_BYTES = 32 << 20
# dW accumulation for half-precision operands over more than one chunk: a float32 [V, H] accumulator
# (one rounding at the end, as one GEMM over all rows), or addmm of each chunk into the bf16 dW
# buffer (float32 GEMM accumulation, one rounding of the running sum per chunk; Liger's choice).
# Measured on CPU (bf16, N = 2048, H = 256, V = 4096, relative RMS error of dW):
#   the summation alone, vs float64 of the same bf16 dz: one GEMM / float32 accumulator 1.7e-3 at
#   any chunk count; addmm into bf16 2.0e-3 / 3.4e-3 / 4.7e-3 at 2 / 8 / 16 chunks;
#   end to end, vs float64 logits: 1.27% (one GEMM, float32 accumulator) against 1.30% / 1.34% at
#   8 / 16 chunks: the bf16 logits and their bf16 gradient dominate, the extra roundings add 2-6%.
# So: float32 while it costs at most this much (V x H x 4 bytes; 2.3 GiB at 151936 x 4096, more
# than the chunk itself), addmm into bf16 above (test_dw_accumulation_precision_in_bfloat16).
DW_FLOAT32_BYTES = 1 << 30


def chunk_rows_for(num_rows: int, v_local: int, itemsize: int, dense: bool, device_type: str,
                   chunk_bytes: int | None = None) -> int:
    """Rows per chunk: the largest power of two whose z (and u) fit `chunk_bytes` (default
    `CHUNK_BYTES`, `CPU_CHUNK_BYTES` on CPU), at least 1, at most `num_rows`. Every rank of the TP
    group gets the same answer (same V_local), so they run the same collectives."""
    budget = chunk_bytes or (CPU_CHUNK_BYTES if device_type == "cpu" else CHUNK_BYTES)
    fit = max(1, budget // max(1, v_local * itemsize * (2 if dense else 1)))
    return min(1 << (fit.bit_length() - 1), max(1, num_rows))


def select_rows_backend(hidden: torch.Tensor, backend="auto"):
    """The logits backend ("auto" | "triton" | "cpp" | "torch" or an object), None if it cannot
    run here. "auto": Triton on its devices, the C++ twin on CPU when built, else torch."""
    if not isinstance(backend, str):
        return backend
    if backend == "torch":
        return TorchKdBackend()
    picked = select_backend(hidden, backend)
    return TorchKdBackend() if picked is None and backend == "auto" else picked


class _DwSum:
    """dW = sum over chunks of dz^T h[rows]; see DW_FLOAT32_BYTES for the accumulator's dtype."""

    def __init__(self, w: torch.Tensor, num_chunks: int, dw_float32: bool | None):
        self.w, self.num_chunks, self.out = w, num_chunks, None
        half = w.dtype not in (torch.float32, torch.float64)
        if dw_float32 is None:
            dw_float32 = w.numel() * 4 <= DW_FLOAT32_BYTES
        self.acc = (torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                    if half and dw_float32 and num_chunks > 1 else None)

    def add(self, dz_T: torch.Tensor, x: torch.Tensor) -> None:
        if self.acc is not None:
            addmm_f32_(self.acc, dz_T, x)
        elif self.out is None:
            self.out = torch.mm(dz_T, x)   # the first (or only) chunk: written, not added
        else:
            self.out.addmm_(dz_T, x)

    def result(self) -> torch.Tensor:
        if self.acc is not None:
            return self.acc.to(self.w.dtype)
        return self.out if self.out is not None else torch.zeros_like(self.w)


def _chunk(inp: LinearInputs, rows: slice, ids, logprobs, c, spec, backend, group, need_grad: bool):
    """Loss, masses, lse and teacher top-1 of `rows`, and dz [R, V] (written over z) or None."""
    cols = slice(0, inp.vocab)
    z = logits_block(inp.hidden, inp.weight, rows, cols, inp.student_end, inp.hidden.dtype)
    u = None
    if inp.teacher_hidden is not None:
        u = logits_block(inp.teacher_hidden, inp.teacher_weight, rows, cols, inp.teacher_end,
                         inp.hidden.dtype)
    part_ids = None if ids is None else ids[rows]
    part_lp = None if logprobs is None else logprobs[rows]
    loss, teacher_mass, student_mass, state = kd_objective(z, u, part_ids, part_lp, spec, backend, group,
                                                           need_grad)
    # the gradient pass reads u anyway: where it can, it also finds the teacher's row maxima
    fused_top1 = (need_grad and u is not None and state.s_S is None
                  and getattr(backend, "writes_teacher_top1", False))
    if fused_top1:
        top_val = torch.empty_like(loss)
        top_col = torch.empty(loss.shape, dtype=torch.int64, device=loss.device)
    elif u is not None:
        top_val, top_col = u.max(dim=1)
    if need_grad:
        write_kd_grad(z, u, state, c[rows], z, spec, backend, (top_val, top_col) if fused_top1 else None)
        if inp.student_end < inp.vocab:   # padding columns are constants, not functions of W
            z[:, inp.student_end:] = 0
    if u is not None:
        top1 = global_argmax(top_val.float(), top_col, tp_rank(group) * inp.vocab, group)
    else:
        top1 = torch.full_like(loss, -1, dtype=torch.int64)
    return (loss, teacher_mass, student_mass, state.lse, top1), (z if need_grad else None)


class RowsLinearKdLoss(torch.autograd.Function):
    """forward(h, W, h_t | None, W_t | None, ids | None, logprobs | None, c [N], spec, backend, group,
    ends, chunk_rows, dw_float32, grad_mode) -> (sum_n c_n loss_n, loss [N], teacher mass [N],
    student mass [N],
    lse [N, 2], teacher top-1 [N]); only the first is differentiable, w.r.t. h and W."""

    @staticmethod
    def forward(ctx, h, w, h_t, w_t, ids, logprobs, c, spec: KdSpec, backend, group, ends, chunk_rows: int,
                dw_float32, grad_mode: bool):
        LAUNCHES[f"rows-{backend.name}"] += 1
        inp = LinearInputs(h, w, h_t, w_t, *ends)
        # forward runs with grad mode off: the caller's mode says whether a backward can follow
        need_h, need_w = grad_mode and ctx.needs_input_grad[0], grad_mode and ctx.needs_input_grad[1]
        n = inp.num_rows
        chunks = row_blocks(n, chunk_rows)
        d_h = torch.empty_like(h) if need_h else None
        d_w = _DwSum(w, len(chunks), dw_float32) if need_w else None
        f32 = {"dtype": torch.float32, "device": h.device}
        loss, teacher_mass, student_mass = (torch.empty(n, **f32) for _ in range(3))
        lse, top1 = torch.empty(n, 2, **f32), torch.empty(n, dtype=torch.int64, device=h.device)
        for rows in chunks:
            stats, dz = _chunk(inp, rows, ids, logprobs, c, spec, backend, group, need_h or need_w)
            for out, value in zip((loss, teacher_mass, student_mass, lse, top1), stats):
                out[rows] = value
            if d_h is not None:
                torch.mm(dz, w, out=d_h[rows])
            if d_w is not None:
                d_w.add(dz.T, h[rows])
            del dz   # free the chunk before the next one's logits
        # where, not c * loss: a row with weight 0 adds nothing even when its loss is not finite
        scalar = torch.where(c != 0, c * loss, torch.zeros_like(loss)).sum()
        ctx.grads = (d_h, d_w.result() if d_w is not None else None)
        ctx.scale = getattr(backend, "scale_", None) or torch.Tensor.mul_
        ctx.mark_non_differentiable(loss, teacher_mass, student_mass, lse, top1)
        return scalar, loss, teacher_mass, student_mass, lse, top1

    @staticmethod
    def backward(ctx, grad_scalar, *_unused):
        if ctx.grads is None:
            raise RuntimeError("rows engine: its gradients were computed in the forward and are handed out "
                               "once; a second backward through the same loss needs a second forward")
        d_h, d_w = ctx.grads
        ctx.grads = None
        g = grad_scalar.float()   # scaled in place: the stored gradients are not needed again
        d_h, d_w = (None if d is None else ctx.scale(d, g) for d in (d_h, d_w))
        return (d_h, d_w, None, None, None, None, None, None, None, None, None, None, None, None)


class RowsLinearKdResult(tuple):
    """`(scalar, loss, teacher_mass, student_mass, lse, teacher_top1)`: sum_n c_n loss_n (the only
    differentiable entry), the per-token loss [N] and the logging stats of `LinearKdResult`."""

    @property
    def scalar(self):
        return self[0]

    @property
    def loss(self):
        return self[1]


def check_row_weights(row_weights, hidden):
    n = hidden.shape[0]
    if not (isinstance(row_weights, torch.Tensor) and row_weights.is_floating_point()
            and tuple(row_weights.shape) == (n,) and row_weights.device == hidden.device):
        got = (f"{row_weights.dtype} {tuple(row_weights.shape)} on {row_weights.device.type}"
               if isinstance(row_weights, torch.Tensor) else type(row_weights).__name__)
        raise ValueError(f"row_weights: expected a floating tensor of shape [N={n}] on the hidden states' "
                         f"device ({hidden.device.type}) (d scalar / d loss_n), got {got}")


def rows_linear_kd_loss(hidden: torch.Tensor, weight: torch.Tensor,
                        teacher_hidden: torch.Tensor | None = None,
                        teacher_weight: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                        topk_logprobs: torch.Tensor | None = None, *, row_weights: torch.Tensor,
                        spec: KdSpec | None = None, tp_group=None, backend="auto",
                        student_vocab_end: int | None = None, teacher_vocab_end: int | None = None,
                        chunk_rows: int | None = None, chunk_bytes: int | None = None,
                        dw_float32: bool | None = None) -> RowsLinearKdResult:
    """sum_n row_weights[n] * loss[n] of the logits `hidden @ weight.T`, one chunk of rows at a time.

    Operands and teacher as `fused_linear_kd.fused_linear_kd_loss`. `row_weights [N]`: the weights
    of the scalar (treated as constants). `backend`: the logits backend (`select_rows_backend`).
    `chunk_rows` (default from `chunk_bytes`, see `chunk_rows_for`; the same on every TP rank).
    `dw_float32`: accumulate dW of half operands in float32 (default: when [V, H] float32 fits
    DW_FLOAT32_BYTES). Inputs are assumed valid in content; bad shapes and dtypes raise ValueError.
    """
    spec = spec or KdSpec()
    check_linear_inputs(hidden, weight, teacher_hidden, teacher_weight, topk_ids, topk_logprobs, spec)
    check_row_weights(row_weights, hidden)
    impl = select_rows_backend(hidden, backend)
    if impl is None:
        raise ValueError(f"backend: {backend!r} cannot run on a {hidden.device.type} tensor here")
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(hidden.shape[0], weight.shape[0], hidden.element_size(),
                                    teacher_hidden is not None, hidden.device.type, chunk_bytes)
    elif not (isinstance(chunk_rows, int) and chunk_rows >= 1):
        raise ValueError(f"chunk_rows: expected a positive int or None, got {chunk_rows!r}")
    ends = shard_ends(weight.shape[0], student_vocab_end, teacher_vocab_end)
    out = RowsLinearKdLoss.apply(row_major(hidden), row_major(weight), row_major(teacher_hidden),
                                 row_major(teacher_weight), topk_ids, topk_logprobs,
                                 row_weights.detach().float().contiguous(), spec, impl, tp_group, ends,
                                 chunk_rows, dw_float32, torch.is_grad_enabled())
    return RowsLinearKdResult(out)
