"""Experiment: forward KL loss + in-place gradient in ONE Triton launch (TP=1), against the two-kernel path.

Every variant computes, per row, loss = KL(p_teacher || q_student) and writes g = w_row (q - p) into
the student buffer (bf16, in place). Bytes counted: read s + read t + write g = 3 logits-sized
transfers; "% of copy" is relative to dst.copy_(z) (2 x bytes(z) / time) measured in the same run.

    copy                 dst.copy_(z): the bandwidth reference
    current              opkd_kernels.fused_kd_loss forward + torch.autograd.grad (row stats, then grad:
                         s and t read twice; 6 exps per element until 2026-11-25, 4 since)
    fused_row            grid N: pass 1 = per-lane online stats (4 exps/elem, as kd_row_stats), pass 2
                         writes g walking the row's blocks in REVERSE (latest-read blocks first, still in L2)
    fused_row_bmax       the same, pass 1 with one running max per row (tl.max per block, a scalar rescale):
                         2 exps/elem in pass 1, 4 in all
    persistent_row(_bmax) grid = mult x SMs, each program loops rows (fewer rows in flight -> pass 2 hits L2)
    split_row            persistent grid = SMs; G programs share a row (1/G of V each), publish partial stats,
                         meet at a per-row atomic counter (spin with a bounded budget: never hangs, reports
                         FAIL instead), merge, write g over their slice in reverse. Rows in flight = SMs / G.
Config keys: w = num_warps, b = BLOCK_V, x = grid multiplier of SMs, st = tl.range num_stages (software
pipelining of the loads; 1 = none), ev = eviction hints (pass 1 evict_last, pass 2 evict_first),
poly = teacher exp in pass 2 (1) or both passes (2) on the FMA pipe (Cody-Waite + degree-6 polynomial)
instead of MUFU, G = programs per row.

GPU:  python experiments/exp_onepass_kl.py [--sweep 1|2|3]   (--shapes, --repeats, --only REGEX, --json PATH)
CPU:  python experiments/exp_onepass_kl.py --interpret-smoke   (TRITON_INTERPRET=1, tiny shapes, checks only;
      split_row runs as two launches there, stats then merge+grad, since the interpreter runs programs
      one after the other and the spin-wait would deadlock)
"""
from __future__ import annotations

import os
import sys

if "--interpret-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton.jit decorates anything below

import argparse
import importlib.util
import json
import re
import statistics

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------- kernels
@triton.jit
def _exp(x, POLY: tl.constexpr):
    """e^x; POLY: on the FMA pipe (2^j by exponent bits, 2^f by cephes' exp2f polynomial, ~1e-7 rel)."""
    if POLY:
        y = tl.maximum(x * 1.4426950408889634, -126.0)
        j = tl.floor(y + 0.5)
        f = y - j
        p = 1.535336188319500e-4 * f + 1.339887440266574e-3
        p = p * f + 9.618437357674640e-3
        p = p * f + 5.550332471162809e-2
        p = p * f + 2.402264791363012e-1
        p = p * f + 6.931472028550421e-1
        p = p * f + 1.0
        r = (p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)).to(tl.float32, bitcast=True)
    else:
        r = tl.exp(x)
    return r


@triton.jit
def _stats(s_row, t_row, lo, hi, BLOCK_V: tl.constexpr, BMAX: tl.constexpr, POLY: tl.constexpr,
           STAGES: tl.constexpr, EV1: tl.constexpr):
    """(m_s, l_s, m_u, l_u, a) of columns [lo, hi): l = sum e^(x-m), a = sum e^(u-m_u) (u-s)."""
    offs = tl.arange(0, BLOCK_V)
    l_s = tl.zeros([BLOCK_V], tl.float32)
    l_u = tl.zeros([BLOCK_V], tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)
    if BMAX:   # one running max per row (scalar)
        m_s = tl.max(tl.full([BLOCK_V], -1e30, tl.float32), 0)
        m_u = tl.max(tl.full([BLOCK_V], -1e30, tl.float32), 0)
    else:      # one running max per lane
        m_s = tl.full([BLOCK_V], -1e30, tl.float32)
        m_u = tl.full([BLOCK_V], -1e30, tl.float32)
    nb = tl.cdiv(hi - lo, BLOCK_V)
    for i in tl.range(0, nb, num_stages=STAGES):
        cols = lo + i * BLOCK_V + offs
        mask = cols < hi
        s = tl.load(s_row + cols, mask=mask, other=-1e30, eviction_policy=EV1).to(tl.float32)
        u = tl.load(t_row + cols, mask=mask, other=-1e30, eviction_policy=EV1).to(tl.float32)
        if BMAX:
            m_s_new = tl.maximum(m_s, tl.max(s, 0))
            m_u_new = tl.maximum(m_u, tl.max(u, 0))
        else:
            m_s_new = tl.maximum(m_s, s)
            m_u_new = tl.maximum(m_u, u)
        a_s = tl.exp(m_s - m_s_new)
        a_u = tl.exp(m_u - m_u_new)
        e_s = tl.where(mask, tl.exp(s - m_s_new), 0.0)
        e_u = tl.where(mask, _exp(u - m_u_new, POLY >= 2), 0.0)
        l_s = l_s * a_s + e_s
        l_u = l_u * a_u + e_u
        acc = acc * a_u + tl.where(e_u > 0, e_u * (u - s), 0.0)   # e == 0 guards 0 * inf
        m_s = m_s_new
        m_u = m_u_new
    if BMAX:
        ms = m_s
        mu = m_u
        ls = tl.sum(l_s, 0)
        lu = tl.sum(l_u, 0)
        a = tl.sum(acc, 0)
    else:
        ms = tl.max(m_s, 0)
        mu = tl.max(m_u, 0)
        ws = tl.exp(m_s - ms)
        wu = tl.exp(m_u - mu)
        ls = tl.sum(l_s * ws, 0)
        lu = tl.sum(l_u * wu, 0)
        a = tl.sum(acc * wu, 0)
    return ms, ls, mu, lu, a


@triton.jit
def _grad(s_row, t_row, lo, hi, lse_s, lse_u, w, BLOCK_V: tl.constexpr, POLY: tl.constexpr,
          STAGES: tl.constexpr, EV2: tl.constexpr):
    """s[lo:hi] <- w (q - p), walking the blocks last to first."""
    offs = tl.arange(0, BLOCK_V)
    nb = tl.cdiv(hi - lo, BLOCK_V)
    for i in tl.range(0, nb, num_stages=STAGES):
        cols = lo + (nb - 1 - i) * BLOCK_V + offs
        mask = cols < hi
        s = tl.load(s_row + cols, mask=mask, other=0.0, eviction_policy=EV2).to(tl.float32)
        u = tl.load(t_row + cols, mask=mask, other=0.0, eviction_policy=EV2).to(tl.float32)
        g = w * (tl.exp(s - lse_s) - _exp(u - lse_u, POLY >= 1))
        tl.store(s_row + cols, g.to(s_row.dtype.element_ty), mask=mask, eviction_policy=EV2)


@triton.jit
def onepass_kl_kernel(s_ptr, t_ptr, loss_ptr, w_ptr, N, V, stride, BLOCK_V: tl.constexpr,
                      BMAX: tl.constexpr, POLY: tl.constexpr, STAGES: tl.constexpr,
                      EV1: tl.constexpr, EV2: tl.constexpr):
    """grid N: one row per program; grid < N: persistent, rows pid, pid + grid, ..."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for i in tl.range(0, tl.cdiv(N - pid, nprog)):
        r = pid.to(tl.int64) + i * nprog
        s_row = s_ptr + r * stride
        t_row = t_ptr + r * stride
        ms, ls, mu, lu, a = _stats(s_row, t_row, 0, V, BLOCK_V, BMAX, POLY, STAGES, EV1)
        lse_s = ms + tl.log(ls)
        lse_u = mu + tl.log(lu)
        tl.store(loss_ptr + r, a / lu - lse_u + lse_s)
        _grad(s_row, t_row, 0, V, lse_s, lse_u, tl.load(w_ptr + r), BLOCK_V, POLY, STAGES, EV2)


@triton.jit
def twopass_kl_kernel(s_ptr, t_ptr, loss_ptr, w_ptr, lse_ptr, N, V, stride, BLOCK_V: tl.constexpr,
                      BMAX: tl.constexpr, POLY: tl.constexpr, STAGES: tl.constexpr, PASS: tl.constexpr):
    """The two-launch design (stats pass, then gradient pass) with this file's pass bodies, grid N."""
    r = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + r * stride
    t_row = t_ptr + r * stride
    if PASS == 1:
        ms, ls, mu, lu, a = _stats(s_row, t_row, 0, V, BLOCK_V, BMAX, POLY, STAGES, "")
        lse_s = ms + tl.log(ls)
        lse_u = mu + tl.log(lu)
        tl.store(lse_ptr + 2 * r, lse_s)
        tl.store(lse_ptr + 2 * r + 1, lse_u)
        tl.store(loss_ptr + r, a / lu - lse_u + lse_s)
    else:
        _grad(s_row, t_row, 0, V, tl.load(lse_ptr + 2 * r), tl.load(lse_ptr + 2 * r + 1), tl.load(w_ptr + r),
              BLOCK_V, POLY, STAGES, "")


@triton.jit
def split_kl_kernel(s_ptr, t_ptr, loss_ptr, w_ptr, part_ptr, cnt_ptr, err_ptr, N, V, stride, chunk,
                    G: tl.constexpr, BLOCK_V: tl.constexpr, BMAX: tl.constexpr, POLY: tl.constexpr,
                    STAGES: tl.constexpr, PHASE: tl.constexpr, SPIN_BUDGET: tl.constexpr):
    """G programs per row, columns [part*chunk, (part+1)*chunk). PHASE 0: all in one launch (atomic
    meeting point per row; needs every program co-resident, i.e. grid <= SMs); 1: partial stats only;
    2: merge + grad only (1 then 2 = the interpreter's stand-in for 0)."""
    pid = tl.program_id(0)
    ngroups = tl.num_programs(0) // G
    part = pid % G
    lo = part * chunk
    hi = tl.maximum(tl.minimum(V, lo + chunk), lo)
    gofs = tl.arange(0, G) * 8
    budget = SPIN_BUDGET   # spins left for the whole program: a broken meeting fails, never hangs
    grp = pid // G
    for i in tl.range(0, tl.cdiv(N - grp, ngroups)):
        r = grp.to(tl.int64) + i * ngroups
        s_row = s_ptr + r * stride
        t_row = t_ptr + r * stride
        pbase = part_ptr + r * (G * 8)
        if PHASE != 2:
            ms, ls, mu, lu, a = _stats(s_row, t_row, lo, hi, BLOCK_V, BMAX, POLY, STAGES, "")
            mine = pbase + part * 8
            tl.store(mine + 0, ms)
            tl.store(mine + 1, ls)
            tl.store(mine + 2, mu)
            tl.store(mine + 3, lu)
            tl.store(mine + 4, a)
        if PHASE == 0:
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + r, 1, sem="release")
            c = tl.atomic_add(cnt_ptr + r, 0, sem="acquire")
            while (c < G) & (budget > 0):
                c = tl.atomic_add(cnt_ptr + r, 0, sem="acquire")
                budget -= 1
            tl.atomic_add(err_ptr, 1, mask=c < G)
            tl.debug_barrier()
        if PHASE != 1:
            pm_s = tl.load(pbase + gofs + 0, volatile=True)
            pl_s = tl.load(pbase + gofs + 1, volatile=True)
            pm_u = tl.load(pbase + gofs + 2, volatile=True)
            pl_u = tl.load(pbase + gofs + 3, volatile=True)
            pa = tl.load(pbase + gofs + 4, volatile=True)
            ms = tl.max(pm_s, 0)
            mu = tl.max(pm_u, 0)
            wu = tl.exp(pm_u - mu)
            lu = tl.sum(pl_u * wu, 0)
            lse_s = ms + tl.log(tl.sum(pl_s * tl.exp(pm_s - ms), 0))
            lse_u = mu + tl.log(lu)
            tl.store(loss_ptr + r, tl.sum(pa * wu, 0) / lu - lse_u + lse_s, mask=part == 0)
            _grad(s_row, t_row, lo, hi, lse_s, lse_u, tl.load(w_ptr + r), BLOCK_V, POLY, STAGES, "")


# ---------------------------------------------------------------- variants
def _c(nw, bv, mult=None, bmax=False, st=1, ev=False, poly=0, G=None):
    return {"nw": nw, "bv": bv, "mult": mult, "bmax": bmax, "st": st, "ev": ev, "poly": poly, "G": G}


SWEEP = [  # (variant, config); ~24 kernel configs, split_row last (a failure there cannot hide others)
    *[("fused_row", _c(nw, bv)) for nw, bv in [(4, 1024), (8, 2048), (8, 4096), (16, 4096)]],
    *[("fused_row_bmax", _c(nw, bv, bmax=True)) for nw, bv in [(4, 1024), (8, 2048), (16, 2048), (16, 4096)]],
    ("fused_row_bmax", _c(8, 2048, bmax=True, ev=True)),
    *[("persistent_row", _c(nw, bv, m)) for nw, bv, m in [(8, 2048, 1), (8, 2048, 2), (16, 4096, 1)]],
    *[("persistent_row_bmax", _c(nw, bv, m, bmax=True))
      for nw, bv, m in [(4, 1024, 2), (8, 2048, 1), (8, 2048, 2), (16, 2048, 1), (16, 4096, 1)]],
    ("persistent_row_bmax", _c(8, 2048, 2, bmax=True, ev=True)),
    ("persistent_row_bmax", _c(8, 2048, 2, bmax=True, st=3)),
    ("persistent_row_bmax", _c(16, 4096, 1, bmax=True, st=3)),
    ("persistent_row_bmax", _c(8, 2048, 2, bmax=True, poly=1)),
    ("persistent_row_bmax", _c(8, 2048, 2, bmax=True, poly=2)),
    *[("split_row", _c(nw, bv, bmax=True, G=g)) for g in (2, 4) for nw, bv in [(8, 2048), (16, 4096)]],
]

SWEEPS = {1: SWEEP}
SWEEPS[2] = [  # the neighbourhood of sweep 1's best (fused_row_bmax w4 b1024), and the two-launch design
    *[("fused_row_bmax", _c(nw, bv, bmax=True, st=st)) for nw, bv, st in
      [(4, 1024, 1), (2, 512, 1), (4, 512, 1), (2, 1024, 1), (8, 1024, 1), (4, 2048, 1),
       (4, 1024, 2), (4, 1024, 3), (4, 512, 3), (8, 1024, 3)]],
    *[("two_kernel_bmax", _c(nw, bv, bmax=True)) for nw, bv in [(4, 1024), (4, 512), (8, 2048)]],
    ("fused_row_bmax", _c(4, 1024, bmax=True, poly=1)), ("fused_row_bmax", _c(4, 1024, bmax=True, poly=2)),
    ("fused_row_bmax", _c(4, 1024, bmax=True, ev=True)),
]
SWEEPS[3] = [  # the two-launch design with pipelined loops, against the one-launch best
    *[("two_kernel_bmax", _c(nw, bv, bmax=True, st=st)) for nw, bv, st in
      [(4, 1024, 1), (4, 1024, 3), (4, 1024, 2), (4, 2048, 3), (8, 2048, 3), (2, 512, 3), (4, 1024, 4)]],
    *[("fused_row_bmax", _c(4, 1024, bmax=True, st=st)) for st in (3, 4)],
]

def cfg_str(c):
    parts = [f"w{c['nw']}", f"b{c['bv']}"]
    parts += [f"x{c['mult']}"] if c["mult"] else []
    parts += [f"G{c['G']}"] if c["G"] else []
    parts += [f"st{c['st']}"] if c["st"] != 1 else []
    parts += ["ev"] if c["ev"] else []
    parts += [f"poly{c['poly']}"] if c["poly"] else []
    return " ".join(parts)


def make_kernel_fn(variant, c, s, t, loss, w, sms):
    """The callable that computes loss and writes g into s in place (one launch, + a memset for split)."""
    n, v = s.shape
    bv = max(16, c["bv"] // 32) if INTERPRET else c["bv"]   # interpreter: multi-block rows on tiny shapes
    common = {"BLOCK_V": bv, "BMAX": c["bmax"], "POLY": c["poly"], "STAGES": c["st"], "num_warps": c["nw"]}
    if variant == "two_kernel_bmax":
        lse = torch.empty(2 * n, dtype=torch.float32, device=s.device)

        def run2():
            twopass_kl_kernel[(n,)](s, t, loss, w, lse, n, v, s.stride(0), PASS=1, **common)
            twopass_kl_kernel[(n,)](s, t, loss, w, lse, n, v, s.stride(0), PASS=2, **common)
        return run2
    if variant != "split_row":
        grid = n if c["mult"] is None else max(1, min(n, c["mult"] * sms))
        ev1, ev2 = ("evict_last", "evict_first") if c["ev"] else ("", "")
        return lambda: onepass_kl_kernel[(grid,)](s, t, loss, w, n, v, s.stride(0), EV1=ev1, EV2=ev2, **common)
    g = c["G"]
    grid = (sms // g) * g
    chunk = triton.cdiv(triton.cdiv(v, g), bv) * bv
    part = torch.empty(n * g * 8, dtype=torch.float32, device=s.device)
    cnt = torch.zeros(n, dtype=torch.int32, device=s.device)
    err = torch.zeros(1, dtype=torch.int32, device=s.device)
    args = (s, t, loss, w, part, cnt, err, n, v, s.stride(0), chunk)

    def run():
        if INTERPRET:
            split_kl_kernel[(grid,)](*args, G=g, PHASE=1, SPIN_BUDGET=0, **common)
            split_kl_kernel[(grid,)](*args, G=g, PHASE=2, SPIN_BUDGET=0, **common)
        else:
            cnt.zero_()
            split_kl_kernel[(grid,)](*args, G=g, PHASE=0, SPIN_BUDGET=1 << 22, **common)
    run.err = err
    return run


def import_opkd():
    try:
        import opkd_kernels
        return opkd_kernels
    except ImportError:   # not installed (e.g. a bare GPU box): load kernels/ under its package name
        kdir = os.path.join(ROOT, "kernels")
        spec = importlib.util.spec_from_file_location("opkd_kernels", os.path.join(kdir, "__init__.py"),
                                                      submodule_search_locations=[kdir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["opkd_kernels"] = mod
        spec.loader.exec_module(mod)
        return mod


# ---------------------------------------------------------------- reference, check, timing
def reference_loss(z0, t, chunk=256):
    out = torch.empty(z0.shape[0], dtype=torch.float64, device=z0.device)
    for i in range(0, z0.shape[0], chunk):
        lq = torch.log_softmax(z0[i:i + chunk].double(), -1)
        lp = torch.log_softmax(t[i:i + chunk].double(), -1)
        out[i:i + chunk] = (lp.exp() * (lp - lq)).sum(-1)
    return out


def check(s_out, loss, z0, t, w, ref_loss, rows):
    """(ok, detail): loss (all rows) vs float64, g (sampled rows) within 1 bf16 ulp + 1e-6 w, every row written."""
    loss_err = (loss.double() - ref_loss).abs().max().item()
    unwritten = int((s_out.abs().amax(dim=1).float() > w * 1.01 + 1e-30).sum().item())
    lq = torch.log_softmax(z0[rows].double(), -1)
    lp = torch.log_softmax(t[rows].double(), -1)
    wr = w[rows].double()[:, None]
    ref = (wr * (lq.exp() - lp.exp())).to(s_out.dtype).double()
    ulp = torch.where(ref == 0, torch.full_like(ref, 2.0 ** -133), torch.ldexp(torch.ones_like(ref),
                      torch.frexp(ref).exponent - 8))
    err = (s_out[rows].double() - ref).abs()
    g_ulps = (err / ulp).max().item()
    ok_g = bool((err <= ulp + 1e-6 * wr).all().item())
    ok = loss_err <= 1e-3 and unwritten == 0 and ok_g and loss.isfinite().all().item()
    return ok, {"loss_max_abs_err": loss_err, "grad_max_err_ulps": g_ulps, "grad_ok": ok_g,
                "rows_unwritten": unwritten}


def timed(fn, reset, warmup, repeats):
    """Median ms of fn() over CUDA events; reset() (re-initialising the in-place buffer) runs outside them."""
    for _ in range(warmup):
        reset()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# ---------------------------------------------------------------- driver
def current_runner(s, t, w):
    """The baseline: (timed callable = forward + autograd backward, (loss, grad written into s) for the check)."""
    opkd = import_opkd()
    leaf = s.detach().requires_grad_()   # shares s's storage: the gradient lands in s, as in training
    spec = opkd.fused_kd.KdSpec(divergence="forward_kl")

    def fwd():
        return opkd.fused_kd_loss(leaf, t, None, None, spec=spec, tp_group=None, inplace_grad=True)

    def for_check():
        loss = fwd()
        torch.autograd.grad(loss, leaf, grad_outputs=w)
        return loss.detach()
    return (lambda: torch.autograd.grad(fwd().sum(), leaf)), for_check


def run_shape(n, v, args, device, sms, out_rows, flush):
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    z0 = (torch.randn(n, v, device=device) * 2).to(dtype)
    t = (torch.randn(n, v, device=device) * 2).to(dtype)
    s = torch.empty_like(z0)
    w = torch.full((n,), 1.0 / n, dtype=torch.float32, device=device)
    loss = torch.empty(n, dtype=torch.float32, device=device)
    ref_loss = reference_loss(z0, t)
    k = min(n, 32)
    rows = sorted(set(range(k)) | set(range(n - k, n)) | set(torch.randint(0, n, (k,)).tolist()))
    rows = torch.tensor(rows, device=device)
    nbytes = 3 * z0.numel() * z0.element_size()
    shape = f"{n}x{v}"
    timing = device == "cuda" and not args.no_timing
    copy_gbps = None
    if timing:
        dst = torch.empty_like(z0)
        ms = timed(lambda: dst.copy_(z0), lambda: None, args.warmup, args.repeats)
        copy_gbps = 2 * z0.numel() * z0.element_size() / ms / 1e6
        del dst
        out_rows.append({"shape": shape, "variant": "copy", "config": "dst.copy_(z)", "ms": ms,
                         "gbps": copy_gbps, "pct_copy": 100.0, "check": "-"})
        flush()

    def reset():
        s.copy_(z0)

    def record(variant, config, setup):
        """setup() -> (timed callable, callable computing loss and g in place for the check)."""
        row = {"shape": shape, "variant": variant, "config": config, "ms": None, "gbps": None, "pct_copy": None}
        try:
            fn, for_check = setup()
            reset()
            ok, detail = check(s, for_check(), z0, t, w, ref_loss, rows)
            if hasattr(fn, "err"):   # split_row: meetings that ran out of spin budget
                detail["spin_timeouts"] = int(fn.err.item())
                ok = ok and detail["spin_timeouts"] == 0
            row.update(check="PASS" if ok else "FAIL", **detail)
            if timing:
                ms = timed(fn, reset, args.warmup, args.repeats)
                gbps = nbytes / ms / 1e6
                row.update(ms=ms, gbps=gbps, pct_copy=100 * gbps / copy_gbps)
        except Exception as e:  # noqa: BLE001  (compile/run failure: report it, go on with the others)
            row.update(check="ERROR", error=f"{type(e).__name__}: {str(e)[:400]}")
            if device == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception as e2:  # noqa: BLE001
                    row["error"] += f" | context: {str(e2)[:200]}"
        out_rows.append(row)
        ms_txt = "" if row["ms"] is None else f"{row['ms']:.3f} ms"
        print(f"  {shape:>14} {variant:<20} {config:<22} {row['check']:<5} {ms_txt} {row.get('error', '')}",
              flush=True)
        flush()

    def kernel_setup(variant, c):
        fn = make_kernel_fn(variant, c, s, t, loss, w, sms)

        def for_check():
            loss.fill_(float("nan"))
            fn()
            return loss
        return fn, for_check

    only = re.compile(args.only) if args.only else None
    if not only or only.search("current"):
        record("current", "fused_kd_loss + autograd.grad", lambda: current_runner(s, t, w))
    for variant, c in SWEEPS[args.sweep]:
        if not only or only.search(variant):
            emul = " (2-launch emulation)" if variant == "split_row" and INTERPRET else ""
            record(variant, cfg_str(c) + emul, lambda variant=variant, c=c: kernel_setup(variant, c))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="NxV list (default 16384x151936,4096x151936; smoke: tiny)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", type=int, default=1, choices=sorted(SWEEPS),
                   help="1: every design; 2: around the best of 1; 3: the two-launch design pipelined")
    p.add_argument("--only", default=None, help="regex on variant names (current, fused_row, split_row, ...)")
    p.add_argument("--no-timing", action="store_true", help="checks only")
    p.add_argument("--interpret-smoke", action="store_true", help="TRITON_INTERPRET=1 on CPU, checks only")
    out_dir = os.environ.get("OUT")
    p.add_argument("--json", default=os.path.join(out_dir, "exp_onepass_kl.json") if out_dir
                   else "exp_onepass_kl.json")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    if device == "cpu" and not INTERPRET:
        sys.exit("no GPU: run with --interpret-smoke (or TRITON_INTERPRET=1)")
    shapes = args.shapes or ("7x1000,3x333,5x4099" if INTERPRET else "16384x151936,4096x151936")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    meta = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
            "sms": sms, "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
            "repeats": args.repeats, "warmup": args.warmup, "interpret": INTERPRET,
            "bytes_counted": "3 x N x V x elem (read s, read t, write g)"}
    note = "  [interpreter: checks only; split_row = 2 launches, spin-wait not exercised]" if INTERPRET else ""
    print(f"# {meta['device']}  SMs={sms}  torch {torch.__version__}  triton {triton.__version__}{note}",
          flush=True)
    rows = []

    def flush():
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    for shp in shapes.split(","):
        n, v = (int(x) for x in shp.lower().split("x"))
        run_shape(n, v, args, device, sms, rows, flush)
        if device == "cuda":
            torch.cuda.empty_cache()

    def fmt(r, key, spec):
        return "-" if r.get(key) is None else format(r[key], spec)
    print("\n| shape | variant | config | ms | GB/s | % of copy | check |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['config']} | {fmt(r, 'ms', '.3f')} | "
              f"{fmt(r, 'gbps', '.0f')} | {fmt(r, 'pct_copy', '.1f')} | {r['check']} |")
    print(f"\nJSON: {args.json}")
    for r in rows:
        if r["check"] in ("FAIL", "ERROR"):
            keys = ("loss_max_abs_err", "grad_max_err_ulps", "rows_unwritten", "spin_timeouts")
            print(f"{r['check']}: {r['shape']} {r['variant']} {r['config']}: "
                  f"{r.get('error') or {k: r.get(k) for k in keys}}")


if __name__ == "__main__":
    main()
