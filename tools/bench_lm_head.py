"""The fused LM-head mode of tools/bench_kernels.py: output layer + KD loss, forward + backward.

Per shape (N tokens, H hidden, V vocabulary; this rank holds V/TP rows of each output weight) and
objective, all in one run, p20 / p50 / p80 ms and peak extra memory of
    gemm_rate  one bf16 GEMM [N, H] x [H, V/TP]: the device's rate for these shapes (TFLOP/s)
    gemms      the GEMMs alone: student logits, teacher logits (dense), dh = G W, dW = G^T h
    fused      opkd_kernels.fused_linear_kd (Triton tiles), gradients of h and W
    chunkedNk  the same function with the chunked engine: cuBLAS GEMMs into [N, N_k] float32 logits
               blocks (all rows, N_k vocabulary columns) + the Triton row kernels (chunked4k/8k/16k)
    rowsNk     opkd_kernels.linear_kd_rows ("rows" engine): per chunk of N_k rows (rows128 ... rows4k; rows:
               the default from its memory budget) the logits once, the logits kernels, dh and dW in
               the forward; the backward only scales them (the 4 GEMM-sized products of `gemms`)
    unfused    the same GEMMs with materialised logits + this project's logits kernel (fused_kd)
    compiled   torch.compile of the unfused torch objective (TP=1)
    liger      Liger-Kernel's LigerFusedLinearJSD (TP=1, dense; jsd_beta 0 = forward KL), if importable
    cce        Cut Cross-Entropy's linear_cross_entropy (TP=1; CE, the floor of the top-k case), if importable
`matmul %` = the GEMM FLOPs the method executes / its time, as % of gemm_rate (the fused kernel
recomputes the logits in backward: 3 student + 2 gradient-free teacher passes, i.e. 6 GEMM-sized
products for dense KD vs the 4 of `gemms`). `extra` = peak allocation above the inputs, including
the bf16 gradients of h and W every method returns (`beyond grads` subtracts them).

    python tools/bench_kernels.py --mode lm_head --out lm_head.json            (TP=1)
    torchrun --nproc_per_node 2 tools/bench_kernels.py --mode lm_head --out lm_head_tp2.json
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from bench_common import percentiles  # tools/ is on the path: bench_kernels.py imports this module

from opkd_kernels.fused_kd import KdSpec, fused_kd_loss
from opkd_kernels.fused_linear_kd import fused_linear_kd_loss

LM_HEAD_OBJECTIVES = {
    "forward_kl": dict(divergence="forward_kl"),
    "jsd": dict(divergence="jsd", beta=0.5),
    "topk256": dict(support="teacher", mass="renorm", k_teacher=256),
}
LM_HEAD_METHODS = "gemm_rate,gemms,fused,chunked8k,rows2k,rows4k,unfused,compiled,liger,cce"


def make_lm_head_inputs(n, hidden, vocab, tp, rank, dtype, obj):
    v_local = vocab // tp
    g = torch.Generator(device="cuda").manual_seed(1234)   # h is replicated over TP ranks
    h = torch.randn(n, hidden, generator=g, device="cuda").to(dtype)
    ht = torch.randn(n, hidden, generator=g, device="cuda").to(dtype)
    gw = torch.Generator(device="cuda").manual_seed(77 + rank)
    # weights scaled so that logits have a spread of ~2-3 (a trained LM's softmax is not uniform)
    w = (torch.randn(v_local, hidden, generator=gw, device="cuda") * 2.5 / hidden ** 0.5).to(dtype)
    wt = (torch.randn(v_local, hidden, generator=gw, device="cuda") * 2.5 / hidden ** 0.5).to(dtype)
    k = obj.get("k_teacher")
    if k is None:
        return h, w, (ht, wt), None
    gk = torch.Generator(device="cuda").manual_seed(99)
    ids = torch.rand(n, vocab, generator=gk, device="cuda").topk(k, dim=1).indices
    logprobs = torch.log_softmax(torch.randn(n, k, generator=gk, device="cuda"), dim=1) - 0.1
    return h, w, None, (ids, logprobs)


def _spec(obj):
    return KdSpec(divergence=obj.get("divergence", "forward_kl"), beta=obj.get("beta", 0.5),
                  support=obj.get("support"), mass=obj.get("mass", "renorm"))


def _leaves(h, w):
    """Leaves aliasing the inputs: every method is made before the rounds start, and a copy of W per
    method would hold 1.2 GB each at the benchmark's size (`autograd.grad` leaves them untouched)."""
    return h.detach().requires_grad_(), w.detach().requires_grad_()


def m_gemm_rate(h, w, dense, topk, obj, group):
    return (lambda: h @ w.T), 2 * h.shape[0] * w.shape[0] * h.shape[1]


def m_gemms(h, w, dense, topk, obj, group):
    grad = torch.randn(h.shape[0], w.shape[0], device="cuda", dtype=h.dtype)

    def run():
        logits = [h @ w.T] + ([dense[0] @ dense[1].T] if dense is not None else [])
        return logits, grad @ w, grad.T @ h
    flops = 2 * h.shape[0] * w.shape[0] * (3 * h.shape[1] + (dense[0].shape[1] if dense else 0))
    return run, flops


def m_fused(h, w, dense, topk, obj, group):
    hl, wl = _leaves(h, w)
    spec = _spec(obj)

    def run():
        loss = fused_linear_kd_loss(hl, wl, *(dense or (None, None)), *(topk or (None, None)), spec=spec,
                                    tp_group=group, backend="triton")
        return torch.autograd.grad(loss.sum(), (hl, wl))
    return run, _recompute_flops(h, w, dense, spec)


def _recompute_flops(h, w, dense, spec):
    """GEMM FLOPs of an engine that recomputes the logits in backward (tiles and chunked)."""
    jsd = spec.divergence == "jsd"
    # student: stats (+ JSD sums) + the backward's recompute + dh + dW; teacher: stats (+ JSD) + recompute
    student = (5 if jsd else 4) * h.shape[1]
    teacher = (3 if jsd else 2) * dense[0].shape[1] if dense else 0
    return 2 * h.shape[0] * w.shape[0] * (student + teacher)


def m_chunked(block_cols: int):
    """The chunked engine on the GPU: cuBLAS GEMMs into [N, C] float32 logits blocks, Triton row kernels."""
    def make(h, w, dense, topk, obj, group):
        from opkd_kernels.linear_kd_chunked import ChunkedLinearKd
        from opkd_kernels.triton_backend import TritonKdBackend

        engine = ChunkedLinearKd(TritonKdBackend(), block_rows=h.shape[0], block_cols=block_cols,
                                 gather_elements=1 << 26)
        hl, wl = _leaves(h, w)
        spec = _spec(obj)

        def run():
            loss = fused_linear_kd_loss(hl, wl, *(dense or (None, None)), *(topk or (None, None)), spec=spec,
                                        tp_group=group, backend=engine)
            return torch.autograd.grad(loss.sum(), (hl, wl))
        return run, _recompute_flops(h, w, dense, spec)
    return make


def m_rows(chunk_rows: int | None):
    """The rows engine: gradients in the forward, one chunk of `chunk_rows` rows (all columns) at a time."""
    def make(h, w, dense, topk, obj, group):
        from opkd_kernels.linear_kd_rows import rows_linear_kd_loss

        hl, wl = _leaves(h, w)
        spec = _spec(obj)
        weights = torch.full((h.shape[0],), 1.0 / h.shape[0], device=h.device)   # token-mean

        def run():
            scalar = rows_linear_kd_loss(hl, wl, *(dense or (None, None)), *(topk or (None, None)),
                                         row_weights=weights, spec=spec, tp_group=group,
                                         chunk_rows=chunk_rows)[0]
            return torch.autograd.grad(scalar, (hl, wl))
        return run, 2 * h.shape[0] * w.shape[0] * (3 * h.shape[1] + (dense[0].shape[1] if dense else 0))
    return make


def m_unfused(h, w, dense, topk, obj, group):
    hl, wl = _leaves(h, w)
    spec = _spec(obj)

    def run():
        z = hl @ wl.T
        t = dense[0] @ dense[1].T if dense else None
        loss = fused_kd_loss(z, t, *(topk or (None, None)), spec=spec, tp_group=group, inplace_grad=True)
        return torch.autograd.grad(loss.sum(), (hl, wl))
    return run, 2 * h.shape[0] * w.shape[0] * (3 * h.shape[1] + (dense[0].shape[1] if dense else 0))


def _plain(h, w, ht, wt, divergence: str, beta: float):
    log_q = torch.log_softmax((h @ w.T).float(), dim=-1)
    log_p = torch.log_softmax((ht @ wt.T).float(), dim=-1)
    if divergence == "forward_kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    log_m = torch.logaddexp(log_p + torch.log(torch.tensor(beta)), log_q + torch.log(torch.tensor(1 - beta)))
    return (beta * log_p.exp() * (log_p - log_m) + (1 - beta) * log_q.exp() * (log_q - log_m)).sum(-1)


def m_compiled(h, w, dense, topk, obj, group):
    if dense is None or dist.get_world_size(group) > 1:
        return None
    fn = torch.compile(_plain, dynamic=False)
    hl, wl = _leaves(h, w)
    div, beta = obj.get("divergence", "forward_kl"), obj.get("beta", 0.5)

    def run():
        return torch.autograd.grad(fn(hl, wl, dense[0], dense[1], div, beta).sum(), (hl, wl))
    return run, 2 * h.shape[0] * w.shape[0] * (3 * h.shape[1] + dense[0].shape[1])


def m_liger(h, w, dense, topk, obj, group):
    if dense is None or dist.get_world_size(group) > 1:
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
    except ImportError:
        return None
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(obj.get("divergence"), obj.get("beta", 0.5))
    jsd = LigerFusedLinearJSD(jsd_beta=beta)
    hl, wl = _leaves(h, w)

    def run():
        return torch.autograd.grad(jsd(hl, wl, dense[0], dense[1], None), (hl, wl))  # no labels: every row
    return run, None


def m_cce(h, w, dense, topk, obj, group):
    if dist.get_world_size(group) > 1:
        return None
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    hl, wl = _leaves(h, w)
    target = torch.randint(0, w.shape[0], (h.shape[0],), device="cuda")

    def run():
        return torch.autograd.grad(linear_cross_entropy(hl, wl, target).sum(), (hl, wl))
    return run, None


LM_HEAD_METHOD_FNS = {"gemm_rate": m_gemm_rate, "gemms": m_gemms, "fused": m_fused, "unfused": m_unfused,
                      "compiled": m_compiled, "liger": m_liger, "cce": m_cce,
                      "chunked4k": m_chunked(4096), "chunked8k": m_chunked(8192),
                      "chunked16k": m_chunked(16384), "rows": m_rows(None), "rows128": m_rows(128),
                      "rows256": m_rows(256), "rows512": m_rows(512), "rows1k": m_rows(1024),
                      "rows2k": m_rows(2048), "rows4k": m_rows(4096)}


def _make_methods(h, w, dense, topk, obj, group, names: list[str]) -> dict:
    """method -> (run, flops) or an error row's message; methods with nothing to run are left out."""
    made = {}
    for method in names:
        try:
            out = LM_HEAD_METHOD_FNS[method](h, w, dense, topk, obj, group)
        except Exception as e:  # a peer failing must not hide the other columns
            out = f"{type(e).__name__}: {str(e)[:120]}"
        if out is not None:
            made[method] = out
    return made


def _time_method(made, timed, args, group) -> tuple[float, int] | str:
    if isinstance(made, str):
        return made
    try:
        return timed(made[0], "cuda", args.repeats, args.warmup, group)
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:120]}"
    finally:
        torch.cuda.empty_cache()


def bench_lm_head_cell(n, hidden, vocab, name, args, group, rank, tp, timed):
    """One row per method. With `--rounds R` the methods are timed round robin R times (GEMMs,
    then each method, then GEMMs again...), so a device that slows as it heats up slows every
    column alike; a row's ms (p20, p80) are the percentiles of the rounds' medians, `ms_rounds` keeps
    each round's; with one round, of that round's repeats."""
    obj = LM_HEAD_OBJECTIVES[name]
    dtype = getattr(torch, args.dtype)
    h, w, dense, topk = make_lm_head_inputs(n, hidden, vocab, tp, rank, dtype, obj)
    grad_bytes = (h.numel() + w.numel()) * h.element_size()
    logits_bytes = n * w.shape[0] * h.element_size()
    made = _make_methods(h, w, dense, topk, obj, group, args.methods.split(","))
    results: dict[str, list] = {m: [] for m in made}
    for _ in range(max(1, args.rounds)):
        for method, m in made.items():
            results[method].append(_time_method(m, timed, args, group))
    rows, rate = [], None
    for method, got in results.items():
        row = dict(mode="lm_head", n=n, hidden=hidden, vocab=vocab, tp=tp, objective=name, method=method,
                   dtype=args.dtype)
        errors = [g for g in got if isinstance(g, str)]
        if errors:
            rows.append({**row, "error": errors[0]})
            continue
        rounds = [g[0]["p50"] for g in got]
        pct = percentiles(rounds) if len(rounds) > 1 else got[0][0]
        ms, peak = pct["p50"], got[0][1]
        flops = made[method][1]
        row.update(ms=ms, ms_p20=pct["p20"], ms_p80=pct["p80"], ms_rounds=rounds, peak_extra_bytes=peak,
                   logits_bytes=logits_bytes)
        if method == "gemm_rate":
            rate = flops / ms / 1e9
            row.update(tflops=rate)
        else:
            row.update(beyond_grads_bytes=peak - grad_bytes)
            if flops is not None:
                row.update(tflops=flops / ms / 1e9)
        rows.append(row)
    gemms = next((r["ms"] for r in rows if r["method"] == "gemms" and "ms" in r), None)
    for r in rows:
        if rate and "tflops" in r:
            r["matmul_pct_of_rate"] = 100 * r["tflops"] / rate
        if gemms and "ms" in r and r["method"] != "gemm_rate":
            r["x_gemms"] = r["ms"] / gemms
    return rows


def print_lm_head_table(rows):
    head = (f"{'N x H x V':>20} {'tp':>2} {'objective':>10} {'method':>9} {'ms':>8} {'x gemms':>7} "
            f"{'TFLOP/s':>8} {'matmul%':>7} {'extra GiB':>9} {'beyond grads':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = f"{r['n']}x{r['hidden']}x{r['vocab']}"
        if "error" in r:
            print(f"{shape:>20} {r['tp']:>2} {r['objective']:>10} {r['method']:>9} {r['error']}")
            continue
        beyond = f"{r['beyond_grads_bytes'] / 2**30:.2f}" if "beyond_grads_bytes" in r else ""
        print(f"{shape:>20} {r['tp']:>2} {r['objective']:>10} {r['method']:>9} {r['ms']:8.1f} "
              f"{r.get('x_gemms', float('nan')):7.2f} {r.get('tflops', float('nan')):8.0f} "
              f"{r.get('matmul_pct_of_rate', float('nan')):7.1f} {r['peak_extra_bytes'] / 2**30:9.2f} "
              f"{beyond:>12}")
