"""Triton kernel: a dense forward / reverse KL loss and its gradient from one read of the logits.

The two-pass path reads the student's and the teacher's logits twice (row statistics in the forward,
the gradient in the backward): five logits-sized transfers per call. Where the gradient's per-row
weights c_n are known in the forward (the rows engine; `fused_kd.fused_kd_loss_weighted`) and no TP
all-reduce has to run between the statistics and the gradient, three suffice. A row is cut into
TILES tiles; each tile is one work item, whose program

    loads the tile's s = z / T and u = t / T into registers (once),
    computes the tile's statistics (max, sum of exps, the KL sums) and publishes them,
    waits until the row's other tiles have published theirs (a per-row counter),
    merges them into the row's log-partitions and loss, and writes its tile of
    c_n d loss_n / dz from the registers (in place over z when asked).

Waiting on another program is safe only while every program of a row runs at once: the grid is
persistent (at most the number of programs the GPU holds at once, `resident_programs`), a multiple
of TILES, and item i goes to program i mod P in round i div P, so each round holds whole rows and
the row's programs are all resident. A wait that outlives `max_spins` polls gives up and writes a
NaN loss for its row (a hang would take the process with it; a NaN is caught by the trainer's
checks and names the step).

`split=True` runs the same code as two launches with no wait: the first publishes every tile's
statistics, the second loads its tile again and writes the gradient (five transfers, as the
two-pass path). The interpreter runs programs one after another, so it can only take this form;
CPU tests run the merge and the gradient through it.

Per-tile record (8 float32): m_s / T, l_s, m_u / T, l_u, a / T, b / T, the raw teacher maximum,
the tile's first column holding it (exact in float32 below 2^24 columns).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._jit import interpreting, lazy_jit
from .fused_kd import LAUNCHES
from ._log2 import LOG2E

RECORD = 8
DIV_FORWARD_KL, DIV_REVERSE_KL = 1, 2
MAX_SPINS = 1 << 26   # ~1 us per poll: about a minute before a row gives up


def _kd_one_pass_kernel(z_ptr, t_ptr, g_ptr, w_ptr, part_ptr, count_ptr, loss_ptr, lse_ptr, top_val_ptr,
                        top_col_ptr, z_stride, t_stride, g_stride, n_rows, V, inv_T, exp2_scale, max_spins,
                        DIVERGENCE: tl.constexpr, TILES: tl.constexpr, TILES_P2: tl.constexpr,
                        TILE: tl.constexpr, PHASE: tl.constexpr):
    # PHASE 0: one pass; 1: publish only; 2: write only (the split form). In PHASE 0 a program
    # publishes item i, then writes item i - 1 (published one step earlier: its row is complete by
    # then, or nearly), so the row's wait overlaps a tile's work; one extra step writes the last item.
    offs = tl.arange(0, TILE)
    tiles = tl.arange(0, TILES_P2)
    have = tiles < TILES
    total = n_rows * TILES
    step = tl.num_programs(0)
    item = tl.program_id(0)
    # the next item's tiles are loaded one step ahead: in flight during this step's work
    s_next = tl.load(z_ptr + (item // TILES + tl.zeros([], tl.int64)) * z_stride + (item % TILES) * TILE + offs,
                     mask=((item % TILES) * TILE + offs < V) & (item < total), other=-float("inf"))
    u_next = tl.load(t_ptr + (item // TILES + tl.zeros([], tl.int64)) * t_stride + (item % TILES) * TILE + offs,
                     mask=((item % TILES) * TILE + offs < V) & (item < total), other=-float("inf"))
    e_s_prev = tl.zeros([TILE], tl.float32)
    e_u_prev = tl.zeros([TILE], tl.float32)
    d_prev = tl.zeros([TILE], tl.float32)
    m_s_prev = 0.0
    m_u_prev = 0.0
    for item in range(tl.program_id(0), total + (step if PHASE == 0 else 0), step):
        row = item // TILES + tl.zeros([], tl.int64)   # int64 offsets; the interpreter hands out ints
        tile = item % TILES
        s = s_next.to(tl.float32)
        u = u_next.to(tl.float32)
        nxt = item + step
        n_row = nxt // TILES + tl.zeros([], tl.int64)
        n_cols = (nxt % TILES) * TILE + offs
        s_next = tl.load(z_ptr + n_row * z_stride + n_cols, mask=(n_cols < V) & (nxt < total), other=-float("inf"))
        u_next = tl.load(t_ptr + n_row * t_stride + n_cols, mask=(n_cols < V) & (nxt < total), other=-float("inf"))
        # -1e30 rather than -inf: a tile of -inf logits keeps finite maxima and exps of 0
        m_s = tl.maximum(tl.max(s, 0), -1e30)
        m_u = tl.maximum(tl.max(u, 0), -1e30)
        e_s = tl.exp2(s * exp2_scale - m_s * exp2_scale)
        e_u = tl.exp2(u * exp2_scale - m_u * exp2_scale)
        if PHASE != 2:
            if item < total:   # publish; e > 0 guards 0 * inf (a -inf logit, or a masked lane)
                rec = part_ptr + (row * TILES + tile) * 8
                tl.store(rec + 0, m_s * inv_T)
                tl.store(rec + 1, tl.sum(e_s, 0))
                tl.store(rec + 2, m_u * inv_T)
                tl.store(rec + 3, tl.sum(e_u, 0))
                tl.store(rec + 4, tl.sum(tl.where(e_u > 0, e_u * (u - s), 0.0), 0) * inv_T)
                tl.store(rec + 5, tl.sum(tl.where(e_s > 0, e_s * (s - u), 0.0), 0) * inv_T)
                tl.store(rec + 6, m_u)
                tl.store(rec + 7, (tile * TILE + tl.argmax(u, 0)).to(tl.float32))
                if PHASE == 0:
                    tl.debug_barrier()   # every thread's stores before the release
                    tl.atomic_add(count_ptr + row, 1, sem="release")
        if PHASE == 2:   # write this item (split form)
            w_item = item
            e_s_prev, e_u_prev, d_prev, m_s_prev, m_u_prev = e_s, e_u, s - u, m_s, m_u
        else:            # write the previous item (one pass)
            w_item = item - step
        if (PHASE != 1) & (w_item >= 0):
            w_row = w_item // TILES + tl.zeros([], tl.int64)
            w_tile = w_item % TILES
            complete = True
            if PHASE == 0:   # the row was published a step ago: the first poll usually finds it complete
                arrived = tl.atomic_add(count_ptr + w_row, 0, sem="acquire")
                spins = 0
                while (arrived < TILES) & (spins < max_spins):
                    arrived = tl.atomic_add(count_ptr + w_row, 0, sem="acquire")
                    spins += 1
                complete = arrived >= TILES
            # the row's records in one load (one round trip to L2); volatile: past L1, which may hold
            # a line of these records read before they were written
            recs = part_ptr + (w_row * TILES + tiles) * 8
            fields = tl.arange(0, 8)
            block = tl.load(recs[:, None] + fields[None, :], mask=have[:, None], other=0.0, volatile=True)
            ms_i = tl.where(have, tl.sum(tl.where(fields[None, :] == 0, block, 0.0), 1), -3e38)
            mu_i = tl.where(have, tl.sum(tl.where(fields[None, :] == 2, block, 0.0), 1), -3e38)
            ms = tl.max(ms_i, 0)
            mu = tl.max(mu_i, 0)
            sc_s = tl.exp(ms_i - ms)
            sc_u = tl.exp(mu_i - mu)
            l_s = tl.sum(tl.sum(tl.where(fields[None, :] == 1, block, 0.0), 1) * sc_s, 0)
            l_u = tl.sum(tl.sum(tl.where(fields[None, :] == 3, block, 0.0), 1) * sc_u, 0)
            lse_s = ms + tl.log(l_s)
            lse_u = mu + tl.log(l_u)
            if DIVERGENCE == 1:
                a = tl.sum(tl.sum(tl.where(fields[None, :] == 4, block, 0.0), 1) * sc_u, 0)
                loss = a / l_u - lse_u + lse_s
            else:
                b = tl.sum(tl.sum(tl.where(fields[None, :] == 5, block, 0.0), 1) * sc_s, 0)
                loss = b / l_s - lse_s + lse_u
            c0 = tl.load(w_ptr + w_row).to(tl.float32) * inv_T
            # q = e_s exp(m_s / T - lse_s): the tile's exps rescaled by one scalar, no exp per element
            q = e_s_prev * tl.exp(m_s_prev * inv_T - lse_s)
            if DIVERGENCE == 1:
                g = c0 * (q - e_u_prev * tl.exp(m_u_prev * inv_T - lse_u))
            else:   # c1 = the loss
                g = tl.where(q > 0, c0 * q * (d_prev * inv_T - lse_s + lse_u - loss), 0.0)
            w_cols = w_tile * TILE + offs
            tl.store(g_ptr + w_row * g_stride + w_cols, g.to(g_ptr.dtype.element_ty), mask=w_cols < V)
            if w_tile == 0:
                top_raw = tl.where(have, tl.sum(tl.where(fields[None, :] == 6, block, 0.0), 1), -float("inf"))
                top = tl.max(top_raw, 0)
                first = tl.min(tl.where(have & (top_raw == top), tiles, TILES), 0)
                col = tl.sum(tl.where((tiles[:, None] == first) & (fields[None, :] == 7), block, 0.0))
                tl.store(loss_ptr + w_row, tl.where(complete, loss, float("nan")))
                tl.store(lse_ptr + w_row * 2, lse_s)
                tl.store(lse_ptr + w_row * 2 + 1, lse_u)
                tl.store(top_val_ptr + w_row, top)
                tl.store(top_col_ptr + w_row, col.to(tl.int64))
        if PHASE == 0:
            e_s_prev, e_u_prev, m_s_prev, m_u_prev = e_s, e_u, m_s, m_u
            if DIVERGENCE == 2:
                d_prev = s - u


_KERNEL = lazy_jit(_kd_one_pass_kernel)


def _launch_shape(vocab: int) -> tuple[int, int]:
    """(TILE, num_warps). The interpreter gets small tiles, so that tiny test rows span several."""
    env = os.environ.get("OPKD_ONE_PASS_LAUNCH")   # "TILE,NUM_WARPS", for launch sweeps
    if env:
        tile, warps = env.split(",")
        return int(tile), int(warps)
    if interpreting():
        return 32, 1
    return 4096, 8


@functools.lru_cache(maxsize=None)
def _resident_per_sm(n_regs: int, shared: int, num_warps: int, device_index: int) -> int:
    """Programs of this kernel one SM holds at once (registers, threads, shared memory)."""
    props = torch.cuda.get_device_properties(device_index)
    regs_per_warp = -(-n_regs * 32 // 256) * 256   # allocated per warp in units of 256
    by_regs = props.regs_per_multiprocessor // max(1, regs_per_warp) // num_warps
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else by_threads
    return max(0, min(by_regs, by_threads, by_smem, 32))


def resident_programs(compiled, num_warps: int, device: torch.device) -> int:
    """How many programs of `compiled` the whole GPU runs at once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    compiled._init_handles()   # loads the binary: n_regs is known from then on
    per_sm = _resident_per_sm(compiled.n_regs, compiled.metadata.shared, num_warps, index)
    return per_sm * torch.cuda.get_device_properties(index).multi_processor_count


def one_pass(student: torch.Tensor, teacher: torch.Tensor, out: torch.Tensor, row_weights: torch.Tensor,
             inv_temperature: float, divergence_code: int, split: bool | None = None):
    """Dense forward (code 1) or reverse (2) KL of one shard that is the whole vocabulary: writes
    `out [N, V]` (may be `student`) = d(sum_n w_n loss_n) / dz and returns (loss [N], lse [N, 2],
    teacher row maximum [N] float32, its first column [N] int64). `split`: force (True) or forbid
    (False) the two-launch form; None takes it only where a wait cannot run (see the module doc)."""
    n_rows, vocab = student.shape
    tile, num_warps = _launch_shape(vocab)
    tiles = triton.cdiv(vocab, tile)
    f32 = {"dtype": torch.float32, "device": student.device}
    loss, lse, top_val = torch.empty(n_rows, **f32), torch.empty(n_rows, 2, **f32), torch.empty(n_rows, **f32)
    top_col = torch.empty(n_rows, dtype=torch.int64, device=student.device)
    if n_rows == 0:
        return loss, lse, top_val, top_col
    part = torch.empty(n_rows * tiles * RECORD, **f32)
    count = torch.zeros(n_rows, dtype=torch.int32, device=student.device)
    args = (student, teacher, out, row_weights, part, count, loss, lse, top_val, top_col, student.stride(0),
            teacher.stride(0), out.stride(0), n_rows, vocab, float(inv_temperature),
            float(inv_temperature) * LOG2E.value, MAX_SPINS)
    meta = dict(DIVERGENCE=divergence_code, TILES=tiles, TILES_P2=triton.next_power_of_2(tiles), TILE=tile,
                num_warps=num_warps)
    kernel = _KERNEL.get()
    programs = 0
    if not interpreting() and split is not True:
        compiled = kernel.warmup(*args, PHASE=0, grid=(1,), **meta)
        programs = min(resident_programs(compiled, num_warps, student.device) // tiles * tiles, n_rows * tiles)
    if programs >= tiles:
        LAUNCHES["one-pass"] += 1
        kernel[(programs,)](*args, PHASE=0, **meta)
    elif split is False:
        raise ValueError(f"one_pass: a row of {tiles} tiles does not fit the GPU at once and split=False")
    else:
        LAUNCHES["one-pass-split"] += 1
        kernel[(n_rows * tiles,)](*args, PHASE=1, **meta)
        kernel[(n_rows * tiles,)](*args, PHASE=2, **meta)
    return loss, lse, top_val, top_col
