"""Context parallelism without attention (CPU): the load-balanced partition of packed sequences against
a brute-force reference, each CP rank's share of a batch, and the distillation loss on CP-sharded tokens
over two real processes (gloo), which must add up to the unsharded loss and logits gradient."""
from __future__ import annotations

import itertools

import pytest
import torch

from opkd_mcore.config import LossSection
from opkd_mcore.engine.context_parallel import cp_layout, padded_lengths, partition_indices, shard_batch
from opkd_mcore.engine.packing import pack_sequences
from opkd_mcore.losses import DenseTeacher, TopKTeacher
from opkd_mcore.losses.plan import resolve_loss_plan
from opkd_mcore.train.objective import StepCounts, make_loss_fn
from tests._dist import run_distributed

LENGTHS = [5, 3, 7, 12, 1, 9]  # none a multiple of 4
PROMPTS = [2, 1, 3, 4, 1, 2]
V = 11


def _reference_indices(lengths_padded, cp, rank):
    """Chunk r then chunk 2*cp-1-r of every sequence, by explicit loops."""
    out, start = [], 0
    for n in lengths_padded:
        chunk = n // (2 * cp)
        chunks = [list(range(start + c * chunk, start + (c + 1) * chunk)) for c in range(2 * cp)]
        out += chunks[rank] + chunks[2 * cp - 1 - rank]
        start += n
    return out


@pytest.mark.parametrize("cp, multiple", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3)])
def test_partition_matches_the_reference_covers_every_token_once_and_balances_causal_work(cp, multiple):
    padded = padded_lengths(LENGTHS, cp, multiple)
    assert all(p % (2 * cp) == 0 and p >= n for p, n in itertools.zip_longest(padded, LENGTHS, fillvalue=0))
    assert sum(padded) % (2 * cp * multiple) == 0
    cu = torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
    parts = [partition_indices(cu, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        assert part.tolist() == _reference_indices(padded, cp, r)
        assert part.numel() == sum(padded) // cp and part.numel() % multiple == 0
    assert sorted(torch.cat(parts).tolist()) == list(range(sum(padded)))
    # causal attention work of a token ~ its position + 1: every rank gets the same, sequence by sequence
    starts = cu[:-1].long()
    for i, n in enumerate(padded):
        work = [int((p[(p >= starts[i]) & (p < starts[i] + n)] - starts[i] + 1).sum()) for p in parts]
        assert len(set(work)) == 1, (i, work)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in LENGTHS]
    t = sum(LENGTHS)
    logprobs = torch.randn(t, 4, generator=g, dtype=torch.float64).log_softmax(-1)
    ids = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(t)])
    ids[::5, -1] = -1  # some padded top-k slots
    logprobs[::5, -1] = float("-inf")
    sampler = [[-0.5] * (n - p) for n, p in zip(LENGTHS, PROMPTS)]
    teacher = TopKTeacher(ids=ids, logprobs=logprobs)
    return pack_sequences(seqs, PROMPTS, sampler_logprobs=sampler, teacher=teacher)


@pytest.mark.parametrize("cp, multiple", [(2, 1), (4, 1), (2, 3)])
def test_shards_reassemble_to_the_batch_and_padding_rows_carry_no_loss(cp, multiple):
    batch = _batch()
    t = batch.num_tokens
    seen = torch.zeros(t, dtype=torch.long)
    sizes = set()
    for r in range(cp):
        s = shard_batch(batch, cp, r, multiple)
        src, real = s.context.source, s.context.source >= 0
        sizes.add(s.num_tokens)
        assert s.num_tokens % multiple == 0 and s.num_sequences == batch.num_sequences
        seen.index_add_(0, src[real], torch.ones(int(real.sum()), dtype=torch.long))
        assert torch.equal(s.tokens[real], batch.tokens[src[real]])
        assert torch.equal(s.position_ids[real], batch.position_ids[src[real]])  # the full sequence's
        assert torch.equal(s.loss_mask[real], batch.loss_mask[src[real]])
        assert torch.equal(s.next_tokens[real], torch.roll(batch.tokens, -1)[src[real]])
        assert torch.equal(s.sampler_logprobs[real], batch.sampler_logprobs[src[real]])
        assert torch.equal(s.teacher.ids[real], batch.teacher.ids[src[real]])
        assert torch.equal(s.teacher.logprobs[real], batch.teacher.logprobs[src[real]])
        assert not s.loss_mask[~real].any() and bool((s.teacher.ids[~real] == -1).all())
        # RoPE reads the padded boundaries; the padded positions continue each sequence
        assert s.context.cu_seqlens[:batch.num_sequences + 1].tolist() == batch.cu_seqlens.tolist()
        assert s.context.max_seqlen == max(padded_lengths(LENGTHS, cp, multiple))
    assert torch.equal(seen, torch.ones(t, dtype=torch.long)) and len(sizes) == 1


def test_a_teacher_on_its_own_packing_is_refused():
    batch = _batch()
    batch.teacher_tokens = pack_sequences([[1, 2, 3]], [1])
    with pytest.raises(ValueError, match="its own packing.*parallel.cp: 1"):
        shard_batch(batch, 2, 0)


def _logits(batch, seed=1):
    """Rows of the whole (unsharded) batch, sliced to a shard's rows when `batch` is one."""
    n = sum(LENGTHS)
    full = torch.randn(n, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return full if batch.context is None else full[batch.context.source.clamp(min=0)]


def _loss_and_grad(batch, logits, loss: LossSection, dense: bool, counts: StepCounts):
    if dense:
        batch.teacher = DenseTeacher(_logits(batch, seed=2))
    kind = "dense" if dense else "topk"
    plan = resolve_loss_plan(loss, device="cpu", dtype=torch.float64, teacher_kind=kind)
    leaf = logits.clone().requires_grad_(True)
    scalar, metrics = make_loss_fn(plan, counts)(leaf, batch)
    scalar.backward()
    return scalar.detach(), leaf.grad, metrics


CASES = {
    "topk_forward_kl": (LossSection(support="teacher"), False),
    "dense_jsd": (LossSection(divergence="jsd", beta=0.3), True),
    "topk_tail_reverse_kl": (LossSection(divergence="reverse_kl", support="teacher", mass="tail"), False),
}


def _cp_rank(rank, world):
    """Per loss case: (loss summed over the CP group, logits gradient, rows' sources, metrics); and the
    whole batch's logits gathered back from the ranks."""
    import torch.distributed as dist

    from opkd_mcore.engine.context_parallel import gather_cp_rows

    batch = _batch()
    counts = StepCounts(num_tokens=batch.num_loss_tokens, num_seqs=batch.num_sequences)
    out = {}
    for name, (loss, dense) in CASES.items():
        shard = shard_batch(batch, world, rank)
        scalar, grad, metrics = _loss_and_grad(shard, _logits(shard), loss, dense, counts)
        total = scalar.clone()
        dist.all_reduce(total)  # the engine's sum over DP x CP (Megatron DDP sums the gradients alike)
        out[name] = (total.item(), grad, shard.context.source, {k: float(v) for k, v in metrics.items()})
    shard = shard_batch(batch, world, rank, total_multiple=3)
    return out, gather_cp_rows(_logits(shard), shard.context, dist.group.WORLD)


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_cp_rank, 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_on_cp_sharded_tokens_over_two_processes_equals_the_unsharded_loss(two_ranks, name):
    loss, dense = CASES[name]
    batch = _batch()
    counts = StepCounts(num_tokens=batch.num_loss_tokens, num_seqs=batch.num_sequences)
    ref_loss, ref_grad, ref_metrics = _loss_and_grad(batch, _logits(batch), loss, dense, counts)
    grad = torch.zeros_like(ref_grad)
    metrics = dict.fromkeys(ref_metrics, 0.0)
    for per_case, _ in two_ranks:
        total, local_grad, source, local_metrics = per_case[name]
        assert total == pytest.approx(ref_loss.item(), rel=1e-12, abs=1e-14)
        real = source >= 0
        assert not local_grad[~real].any()  # padding rows get no gradient
        grad[source[real]] += local_grad[real]
        for k, v in local_metrics.items():
            metrics[k] += v
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    # the metrics are float32 sums (the engine adds them over micro-batches and ranks): float32 rounding
    assert metrics == pytest.approx({k: float(v) for k, v in ref_metrics.items()}, rel=1e-6, abs=1e-7)


def test_gathered_rows_come_back_in_the_batch_order(two_ranks):
    for _, gathered in two_ranks:
        assert torch.equal(gathered, _logits(_batch()))


def test_layout_of_a_single_rank_is_the_identity():
    batch = _batch()
    layout = cp_layout(batch.cu_seqlens, 1, 0)
    padded = torch.tensor(padded_lengths(LENGTHS, 1))
    assert layout.source.numel() == int(padded.sum()) and sorted(layout.source[layout.source >= 0].tolist()) \
        == list(range(batch.num_tokens))
