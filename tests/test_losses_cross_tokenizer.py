"""The cross-tokenizer loss (`loss.cross_tokenizer: exact | uld | gold`) against a float64
reference written here, span by span in Python loops: values and gradients, top-k and dense
teachers, and TP = 2 against TP = 1. `exact` with one tokenizer on both sides is the same-tokenizer
`kd_loss`, bit for bit."""
from __future__ import annotations

import math

import pytest
import torch

from opkd_kernels import cpu_backend
from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss
from opkd_mcore.losses.cross_tokenizer import cross_tokenizer_loss
from opkd_mcore.losses.logprobs_at import logprobs_at
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher, concat_cross_teachers, sample_index
from tests._dist import run_distributed
from tests.losses_reference import reference_kd_loss

V_S, V_T, K = 23, 31, 6
# student: 3 prompt + 6 response tokens; teacher: 4 prompt + 6 response tokens
S_PROMPT, T_PROMPT = 3, 4
S_SEQ = [1, 5, 9, 4, 7, 8, 2, 11, 0]
T_SEQ = [2, 6, 3, 9, 10, 20, 12, 13, 25, 1]
SPANS = [((0,), (0,)), ((1, 2), (1,)), ((3,), (2, 3)), ((4,), (4,)), ((5,), (5,))]
EXACT = [True, False, False, False, True]   # span 3 is 1:1 but its two tokens are different strings


def vocab_map() -> dict[int, int]:
    """teacher id -> student id, one to one, partial; the exact spans' tokens map to each other."""
    gen = torch.Generator().manual_seed(7)
    students = torch.randperm(V_S, generator=gen).tolist()
    teachers = torch.randperm(V_T, generator=gen).tolist()
    pairs = dict(zip(teachers[:15], students[:15]))
    for (s_tok, t_tok), exact in zip(SPANS, EXACT):
        s_id, t_id = S_SEQ[S_PROMPT + s_tok[0]], T_SEQ[T_PROMPT + t_tok[0]]
        pairs = {t: s for t, s in pairs.items() if s != s_id and t != t_id}
        if exact:
            pairs[t_id] = s_id
    return pairs


def map_tensor(pairs):
    table = torch.full((V_T,), -1, dtype=torch.int64)
    for t, s in pairs.items():
        table[t] = s
    return table


def teacher_rows(seed=3, dense=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(T_SEQ), V_T, generator=gen, dtype=torch.float64) * 2
    if dense:
        return DenseTeacher(logits)
    lp = torch.log_softmax(logits, dim=-1)
    values, ids = lp.topk(K, dim=-1)
    ids[-1], values[-1] = -1, -math.inf           # the last row scores nothing
    # teacher row 6 predicts T_SEQ[7] (a continuation of span 2): make sure it is not listed
    row, actual = T_PROMPT - 1 + 3, T_SEQ[T_PROMPT + 3]
    keep = ids[row] != actual
    ids[row, :keep.sum()], values[row, :keep.sum()] = ids[row, keep], values[row, keep]
    ids[row, keep.sum():], values[row, keep.sum():] = -1, -math.inf
    return TopKTeacher(ids, values)


def student_logits(seed=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(len(S_SEQ), V_S, generator=gen, dtype=torch.float64) * 2).to(dtype)


def make_teacher(rows):
    index = sample_index(len(S_SEQ), S_PROMPT, T_SEQ, T_PROMPT, SPANS, EXACT)
    return CrossTokenizerTeacher(rows, index, torch.tensor(T_SEQ))


def next_tokens():
    return torch.tensor(S_SEQ[1:] + [0])


# ---------------------------------------------------------------- the float64 reference
def _teacher_logp(rows, u, temperature):
    """{teacher id: logprob} of teacher row u."""
    if isinstance(rows, DenseTeacher):
        return dict(enumerate(torch.log_softmax(rows.logits[u].double() / temperature, 0).tolist()))
    return {i: lp for i, lp in zip(rows.ids[u].tolist(), rows.logprobs[u].double().tolist()) if i >= 0}


def _actual_logp(logp: dict, token: int) -> float:
    return logp[token] if token in logp else min(logp.values()) - math.log(2.0)


def _uld(z, rows, s_tokens, t_tokens, temperature, k):
    r1, u1 = S_PROMPT - 1 + s_tokens[0], T_PROMPT - 1 + t_tokens[0]
    log_q = torch.log_softmax(z / temperature, dim=-1)
    cont_s = sum((log_q[S_PROMPT - 1 + i, S_SEQ[S_PROMPT + i]] for i in s_tokens[1:]),
                 torch.zeros((), dtype=z.dtype))
    a = torch.sort(log_q[r1].exp(), descending=True).values * cont_s.exp()
    base = _teacher_logp(rows, u1, temperature)
    cont_t = sum(_actual_logp(_teacher_logp(rows, T_PROMPT - 1 + j, temperature), T_SEQ[T_PROMPT + j])
                 for j in t_tokens[1:])
    b = torch.tensor(sorted((math.exp(v) for v in base.values()), reverse=True), dtype=torch.float64)[:k]
    b = b * math.exp(cont_t)
    b_rest = math.exp(cont_t) - b.sum()
    width = min(len(b), len(a))
    value = (a[:width] - b[:width]).abs().sum() + b[width:].sum() + (a[width:].sum() - b_rest).abs()
    return value


def reference(z, rows, pairs, *, mode, temperature=1.3, weights=(1.0, 1.0), **kd):
    """Float64 loss per student row, span by span."""
    out = [z[0, 0] * 0.0 for _ in range(len(S_SEQ))]
    k = K if isinstance(rows, TopKTeacher) else kd.pop("k", K)
    for (s_tokens, t_tokens), exact in zip(SPANS, EXACT):
        r1, u1 = S_PROMPT - 1 + s_tokens[0], T_PROMPT - 1 + t_tokens[0]
        if exact and mode != "uld":
            logp = _teacher_logp(rows, u1, temperature)
            if isinstance(rows, DenseTeacher):
                logp = dict(sorted(logp.items(), key=lambda kv: -kv[1])[:k])
            mapped = [(pairs[t], lp) for t, lp in logp.items() if t in pairs]
            topk = TopKTeacher(torch.tensor([[s for s, _ in mapped]]),
                               torch.tensor([[lp for _, lp in mapped]], dtype=torch.float64))
            value = reference_kd_loss(z[r1:r1 + 1], topk, support="teacher", temperature=temperature, **kd)[0]
            out[r1] = out[r1] + (weights[0] if mode == "gold" else 1.0) * value
        elif mode != "exact":
            out[r1] = out[r1] + weights[1] * _uld(z, rows, s_tokens, t_tokens, temperature, k)
    return torch.stack(out)


def run(z, rows, pairs, *, mode, temperature=1.3, weights=(1.0, 1.0), impl="reference", k=None, **kd):
    loss, stats = cross_tokenizer_loss(z, make_teacher(rows), next_tokens(), map_tensor(pairs), mode=mode,
                                       temperature=temperature, exact_weight=weights[0],
                                       uld_weight=weights[1], impl=impl, k=k, **kd)
    return loss, stats


OBJECTIVES = [dict(divergence="forward_kl", mass="renorm"), dict(divergence="reverse_kl", mass="tail"),
              dict(divergence="jsd", beta=0.3, mass="tail", coverage_coef=0.5)]


@pytest.mark.parametrize("mode", ["exact", "uld", "gold"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_topk_teacher_matches_the_float64_reference(mode, objective):
    pairs, rows = vocab_map(), teacher_rows()
    z = student_logits().requires_grad_()
    z_ref = z.detach().clone().requires_grad_()
    weights = (0.7, 1.9) if mode == "gold" else (1.0, 1.0)
    loss, stats = run(z, rows, pairs, mode=mode, weights=weights, **objective)
    ref = reference(z_ref, rows, pairs, mode=mode, weights=weights, **objective)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    w = torch.linspace(-1.0, 2.0, len(S_SEQ), dtype=torch.float64)   # a grad_output that is not 1
    (loss * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-9, atol=1e-11)
    assert stats.exact_rows.sum() == (0 if mode == "uld" else 2)
    assert stats.uld_rows.sum() == {"exact": 0, "uld": 5, "gold": 3}[mode]
    assert (loss[[r for r in range(len(S_SEQ)) if r not in (2, 3, 5, 6, 7)]] == 0).all()


@pytest.mark.parametrize("mode", ["exact", "gold"])
def test_dense_teacher_matches_the_float64_reference(mode):
    pairs, rows = vocab_map(), teacher_rows(dense=True)
    z = student_logits().requires_grad_()
    z_ref = z.detach().clone().requires_grad_()
    loss, _ = run(z, rows, pairs, mode=mode, k=5, divergence="forward_kl", mass="tail")
    ref = reference(z_ref, rows, pairs, mode=mode, k=5, divergence="forward_kl", mass="tail")
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=1e-9, atol=1e-11)


def test_uld_over_the_whole_vocabulary_is_the_untruncated_distance():
    """A dense teacher's top-k covering its vocabulary: the tail entries vanish and the distance
    is the plain sorted-probability L1 of Boizard et al., computed here on full vectors."""
    pairs, rows = vocab_map(), teacher_rows(dense=True)
    z = student_logits()
    loss, _ = run(z, rows, pairs, mode="uld", k=V_T)
    log_q = torch.log_softmax(z / 1.3, dim=-1)
    log_p = torch.log_softmax(rows.logits / 1.3, dim=-1)
    for s_tokens, t_tokens in SPANS:
        r1, u1 = S_PROMPT - 1 + s_tokens[0], T_PROMPT - 1 + t_tokens[0]
        c_s = sum(log_q[S_PROMPT - 1 + i, S_SEQ[S_PROMPT + i]].item() for i in s_tokens[1:])
        c_t = sum(log_p[T_PROMPT - 1 + j, T_SEQ[T_PROMPT + j]].item() for j in t_tokens[1:])
        a = torch.zeros(V_T, dtype=torch.float64)
        a[:V_S] = log_q[r1].exp().sort(descending=True).values * math.exp(c_s)
        b = log_p[u1].exp().sort(descending=True).values * math.exp(c_t)
        assert loss[r1].item() == pytest.approx((a - b).abs().sum().item(), rel=1e-12, abs=1e-12)


def test_packed_samples_equal_one_at_a_time():
    """Two samples packed into one batch (indices shifted, rows concatenated) give each sample's
    loss on its own rows."""
    pairs = vocab_map()
    z1, z2 = student_logits(5), student_logits(6)
    r1, r2 = teacher_rows(3), teacher_rows(4)
    single = [run(z, r, pairs, mode="gold")[0] for z, r in ((z1, r1), (z2, r2))]
    packed = concat_cross_teachers([make_teacher(r1), make_teacher(r2)])
    loss, _ = cross_tokenizer_loss(torch.cat([z1, z2]), packed, torch.cat([next_tokens(), next_tokens()]),
                                   map_tensor(pairs), mode="gold", temperature=1.3, impl="reference")
    torch.testing.assert_close(loss, torch.cat(single), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_exact_with_one_tokenizer_is_the_same_tokenizer_loss_bit_for_bit(impl):
    if impl == "cpp" and not cpu_backend.available():
        pytest.skip("the C++ twin is not built")
    gen = torch.Generator().manual_seed(11)
    n, vocab = 13, 41
    z = torch.randn(n, vocab, generator=gen) * 3
    lp = torch.log_softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
    values, ids = lp.topk(7, dim=-1)
    ids[4, 5:], values[4, 5:] = -1, -math.inf
    rows = TopKTeacher(ids, values.float())
    seq = torch.randint(0, vocab, (n,), generator=gen).tolist()
    spans = [((i,), (i,)) for i in range(n - 1)]
    index = sample_index(n, 1, seq, 1, spans, [True] * (n - 1))
    teacher = CrossTokenizerTeacher(rows, index, torch.tensor(seq))
    for kd in (dict(divergence="forward_kl", mass="renorm"), dict(divergence="jsd", beta=0.2, mass="tail")):
        z_a, z_b = z.clone().requires_grad_(), z.clone().requires_grad_()
        same = kd_loss(z_a, TopKTeacher(ids, values.float()), support="teacher", impl=impl, **kd)
        cross, _ = cross_tokenizer_loss(z_b, teacher, torch.tensor(seq[1:] + [0]), torch.arange(vocab),
                                        mode="exact", impl=impl, **kd)
        assert torch.equal(same[:-1], cross[:-1]) and cross[-1] == 0   # the last row scores nothing
        same[:-1].sum().backward()
        cross.sum().backward()
        assert torch.equal(z_a.grad, z_b.grad)


@pytest.mark.skipif(not cpu_backend.available(), reason="the C++ twin is not built")
def test_float32_logits_through_the_fused_kernels():
    """Logits that are a model output (not a leaf): the kernels write their gradient into the logits
    buffer, after the ULD backward has read it (module docstring)."""
    pairs, rows = vocab_map(), teacher_rows()
    leaf = student_logits(dtype=torch.float32).requires_grad_()
    z = leaf * 1.0
    z_ref = leaf.detach().double().requires_grad_()
    loss, _ = run(z, rows, pairs, mode="gold", impl="cpp", divergence="forward_kl", mass="tail")
    ref = reference(z_ref, rows, pairs, mode="gold", divergence="forward_kl", mass="tail")
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(leaf.grad.double(), z_ref.grad, rtol=1e-4, atol=1e-6)


def test_logprobs_at_in_row_chunks(monkeypatch):
    """Many row chunks give the one-chunk values and gradients (and the float64 log-softmax)."""
    from opkd_mcore.losses import logprobs_at as module

    gen = torch.Generator().manual_seed(2)
    z = torch.randn(9, 37, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 37, (9, 4), generator=gen)
    ids[3, 1] = -1
    ref_in = z.clone().requires_grad_()
    ref = torch.log_softmax(ref_in / 0.7, dim=-1).gather(1, ids.clamp(min=0))
    monkeypatch.setattr(module, "CHUNK_BYTES", 37 * 4 * 2)   # two rows per chunk
    ours_in = z.clone().requires_grad_()
    ours = logprobs_at(ours_in, ids, temperature=0.7)
    valid = ids >= 0
    torch.testing.assert_close(ours[valid], ref[valid], rtol=1e-12, atol=1e-12)
    w = torch.randn(9, 4, generator=gen, dtype=torch.float64) * valid
    (ref * w).sum().backward()
    (ours * w).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- TP = 2 (gloo)
def _tp_worker(rank, world_size, mode, dense):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    pairs = vocab_map()
    rows = teacher_rows(dense=dense)
    if dense:   # the teacher's vocabulary sharded like the student's: V_T padded to 32 = 2 x 16
        full = torch.cat([rows.logits, torch.full((len(T_SEQ), 1), -1e4, dtype=torch.float64)], dim=1)
        rows = DenseTeacher(full[:, rank * 16:(rank + 1) * 16].contiguous())
    z_full = torch.cat([student_logits(), torch.full((len(S_SEQ), 1), -1e4, dtype=torch.float64)], dim=1)
    z = z_full[:, rank * 12:(rank + 1) * 12].clone().requires_grad_()   # V_S padded to 24 = 2 x 12
    loss, _ = cross_tokenizer_loss(z, make_teacher(rows), next_tokens(), map_tensor(pairs), mode=mode,
                                   temperature=1.3, divergence="jsd", beta=0.4, mass="tail", k=5,
                                   tp_group=group, impl="reference")
    (loss * torch.arange(1.0, len(S_SEQ) + 1, dtype=torch.float64)).sum().backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("dense", [False, True])
def test_tp2_equals_tp1(dense):
    pairs, rows = vocab_map(), teacher_rows(dense=dense)
    if dense:
        pad = torch.full((len(T_SEQ), 1), -1e4, dtype=torch.float64)
        rows = DenseTeacher(torch.cat([rows.logits, pad], 1))
    z = torch.cat([student_logits(), torch.full((len(S_SEQ), 1), -1e4, dtype=torch.float64)], dim=1)
    z.requires_grad_()
    loss, _ = cross_tokenizer_loss(z, make_teacher(rows), next_tokens(), map_tensor(pairs), mode="gold",
                                   temperature=1.3, divergence="jsd", beta=0.4, mass="tail", k=5,
                                   impl="reference")
    (loss * torch.arange(1.0, len(S_SEQ) + 1, dtype=torch.float64)).sum().backward()
    results = run_distributed(_tp_worker, 2, "gold", dense)
    for rank, (tp_loss, tp_grad) in enumerate(results):
        torch.testing.assert_close(tp_loss, loss.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(tp_grad, z.grad[:, rank * 12:(rank + 1) * 12], rtol=1e-9, atol=1e-11)


def _triton_gold(rank, world):
    from opkd_kernels.fused_kd import LAUNCHES

    pairs, rows = vocab_map(), teacher_rows()
    leaf = student_logits(dtype=torch.float32).requires_grad_()
    z = leaf * 1.0
    z_ref = leaf.detach().double().requires_grad_()
    loss, _ = run(z, rows, pairs, mode="gold", impl="triton", divergence="jsd", beta=0.3, mass="tail")
    ref = reference(z_ref, rows, pairs, mode="gold", divergence="jsd", beta=0.3, mass="tail")
    loss.sum().backward()
    ref.sum().backward()
    return loss.detach().double(), ref.detach(), leaf.grad.double(), z_ref.grad, LAUNCHES["triton"]


def test_mapped_support_through_the_triton_kernels():
    """The exact term on the Triton kernels (TRITON_INTERPRET=1 on CPU), in a process of its own."""
    (loss, ref, grad, ref_grad, launches), = run_distributed(_triton_gold, 1, env={"TRITON_INTERPRET": "1"})
    assert launches == 1
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
