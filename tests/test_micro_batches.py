"""Token-balanced micro-batches (`parallel.max_tokens_per_micro_batch`): the split over DP ranks and
micro-batches, and a step that equals sequence-count micro-batching (loss, gradients, weights after
a Megatron step over two real DP processes)."""
from __future__ import annotations

import itertools

import pytest
import torch

from opkd_mcore.config import LossSection, ParallelSection, load_config
from opkd_mcore.engine.micro_batches import (
    balanced_partition,
    consecutive_chunks,
    data_parallel_split,
    micro_batch_groups,
    token_budget_micro_batches,
)
from opkd_mcore.losses.plan import resolve_loss_plan
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from opkd_mcore.train.objective import make_loss_fn
from opkd_mcore.train.stages import ShardLayout, pack_micro_batches
from tests._dist import run_distributed
from tests.test_train_stages import V, _scored

PLAN = resolve_loss_plan(LossSection(support="teacher"), device="cpu", dtype=torch.float64, teacher_kind="topk")
LENGTHS = [37, 5, 18, 18, 2, 61, 9, 30, 11, 4, 26, 7]


def _tokens(groups, lengths=LENGTHS):
    return [sum(lengths[i] for i in g) for g in groups]


def test_balanced_partition_deals_every_index_once_and_is_near_optimal():
    for parts, capacity in ((2, None), (3, 4), (4, 3), (5, None)):
        groups = balanced_partition(LENGTHS, parts, capacity)
        assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))
        assert all(g == sorted(g) for g in groups)
        if capacity:
            assert all(len(g) == capacity for g in groups)
    assert balanced_partition(LENGTHS, 3) == balanced_partition(LENGTHS, 3)  # deterministic
    # longest-first greedy is within 4/3 of the best split (Graham's bound); the best by brute force
    lengths = LENGTHS[:8]
    for parts in (2, 3):
        best = min(max(sum(n for n, p in zip(lengths, assign) if p == q) for q in range(parts))
                   for assign in itertools.product(range(parts), repeat=len(lengths)))
        assert max(_tokens(balanced_partition(lengths, parts), lengths)) <= 4 / 3 * best


def test_balanced_partition_of_two_groups_matches_brute_force_on_small_cases():
    lengths = [9, 7, 6, 5, 5, 4]
    groups = balanced_partition(lengths, 2, capacity=3)
    best = min(max(sum(lengths[i] for i in c), sum(lengths) - sum(lengths[i] for i in c))
               for c in itertools.combinations(range(6), 3))
    assert max(_tokens(groups, lengths)) == best == 18


def test_data_parallel_split_by_count_is_contiguous_and_by_tokens_is_balanced():
    assert data_parallel_split(LENGTHS, 3, balance_tokens=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ranks = data_parallel_split(LENGTHS, 3, balance_tokens=True)
    assert [len(r) for r in ranks] == [4, 4, 4]
    contiguous = _tokens(data_parallel_split(LENGTHS, 3, balance_tokens=False))   # 78, 102, 48
    assert max(_tokens(ranks)) - min(_tokens(ranks)) < (max(contiguous) - min(contiguous)) / 4
    with pytest.raises(ValueError, match="do not split over 5 DP ranks"):
        data_parallel_split(LENGTHS, 5, balance_tokens=True)


@pytest.mark.parametrize("budget", [8, 40, 64, 100, 1000])
def test_token_budget_gives_every_rank_the_same_count_within_the_budget(budget):
    ranks = data_parallel_split(LENGTHS, 2, balance_tokens=True)
    split = token_budget_micro_batches(LENGTHS, ranks, budget)
    assert len({len(groups) for groups in split}) == 1
    for rank, groups in zip(ranks, split):
        assert sorted(i for g in groups for i in g) == rank and all(groups)
        assert all(t <= budget or len(g) == 1 for g, t in zip(groups, _tokens(groups)))
    if budget >= sum(LENGTHS):
        assert len(split[0]) == 1


def _step_on_logits(scored, student, par, dp_size):
    """Sum over DP ranks of the step's loss scalars, and the gradient of each sample's logits."""
    leaves = [s.clone().requires_grad_() for s in student]
    total = 0.0
    for dp_rank in range(dp_size):
        shard = ShardLayout(dp_rank=dp_rank, dp_size=dp_size, vocab_local=V, padded_vocab=V)
        batches, counts = pack_micro_batches(scored, par, shard)
        groups = micro_batch_groups([len(s.sequence) for s in scored.samples], dp_size, dp_rank,
                                    micro_batch_size=par.micro_batch_size,
                                    max_tokens=par.max_tokens_per_micro_batch)
        loss_fn = make_loss_fn(PLAN, counts)
        for batch, idx in zip(batches, groups):
            value, _ = loss_fn(torch.cat([leaves[i] for i in idx]), batch)
            value.backward()
            total += float(value.detach())
    return total, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("budget", [1, 30, 61, 100, 1000])
def test_consecutive_chunks_keep_the_order_within_the_budget(budget):
    chunks = consecutive_chunks(LENGTHS, budget)
    assert list(itertools.chain(*chunks)) == list(range(len(LENGTHS)))
    for chunk, tokens in zip(chunks, _tokens(chunks)):
        assert tokens <= budget or len(chunk) == 1
    for a, b in zip(chunks, chunks[1:]):  # no chunk could have taken the next one's first sequence
        assert _tokens([a])[0] + LENGTHS[b[0]] > budget
    with pytest.raises(ValueError, match="max_tokens"):
        consecutive_chunks(LENGTHS, 0)


def test_token_budget_step_equals_sequence_count_step_on_the_loss_and_gradients():
    scored = _scored(num=8, seed=3)
    g = torch.Generator().manual_seed(4)
    student = [torch.randn(len(s.sequence), V, generator=g, dtype=torch.float64) for s in scored.samples]
    reference, ref_grads = _step_on_logits(scored, student, ParallelSection(micro_batch_size=1,
                                                                            global_batch_size=8), 1)
    for budget, dp in ((6, 2), (12, 2), (1000, 1), (9, 4)):
        par = ParallelSection(micro_batch_size=1, global_batch_size=8, max_tokens_per_micro_batch=budget)
        total, grads = _step_on_logits(scored, student, par, dp)
        assert total == pytest.approx(reference, rel=1e-12)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_config_keys_of_the_token_budget(tmp_path):
    student = save_tiny_hf_model(str(tmp_path / "s"), "qwen3", TinyModelShape(vocab_size=V + 20), seed=1)
    base = [f"model.student={student}", "teacher.teachers.0.backend=hf", f"teacher.teachers.0.model={student}",
            "loss.support=teacher", "rollout.prompts_per_step=3", "rollout.n=2", "parallel.global_batch_size=6"]
    cfg = load_config(None, base + ["parallel.max_tokens_per_micro_batch=512", "parallel.micro_batch_size=4"])
    assert cfg.parallel.max_tokens_per_micro_batch == 512  # micro_batch_size need not divide the batch then
    with pytest.raises(ValueError, match="^parallel.max_tokens_per_micro_batch: expected > 0"):
        load_config(None, base + ["parallel.max_tokens_per_micro_batch=0"])
    with pytest.raises(ValueError, match="^parallel.global_batch_size: 6 is not divisible by dp = 4"):
        load_config(None, base + ["parallel.max_tokens_per_micro_batch=64", "parallel.world_size=4"])


def _dp2_step(rank, world, model_dir, budget):
    """One `train_stage` step over two DP ranks; the weights after it (rank 0)."""
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.stages import train_stage
    from tests.test_train_integration import _scored as integration_scored

    init_parallel(ParallelConfig(seed=3))
    try:
        # adam_eps=1: the update is ~ lr * g, so the weights after the step compare the gradients
        engine, _ = build_student(model_dir, OptimSection(lr=1.0, adam_eps=1.0, clip_grad=0.0))
        par = ParallelSection(micro_batch_size=1, global_batch_size=4, max_tokens_per_micro_batch=budget)
        plan = resolve_loss_plan(LossSection(support="teacher"), device="cpu", dtype=torch.float32,
                                 teacher_kind="topk")
        result = train_stage(engine, integration_scored(5, False), plan, par, shard_layout(engine))
        return result.metrics, [p.detach().clone() for p in engine.parameters()]
    finally:
        destroy_parallel()


@pytest.mark.slow
def test_token_budget_megatron_step_over_two_dp_ranks_equals_sequence_count(tmp_path):
    from tests.test_train_integration import ALPHABET
    from tests.test_train_integration import V as INTEGRATION_V

    shape = TinyModelShape(vocab_size=INTEGRATION_V, hidden_size=64, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    model = save_tiny_hf_model(str(tmp_path / "student"), "qwen3", shape, seed=1, alphabet=ALPHABET)
    (by_count, count_params), _ = run_distributed(_dp2_step, 2, model, None)
    (by_tokens, token_params), _ = run_distributed(_dp2_step, 2, model, 12)
    assert by_tokens["train/loss"] == pytest.approx(by_count["train/loss"], rel=1e-5)
    assert by_tokens["train/grad_norm"] == pytest.approx(by_count["train/grad_norm"], rel=1e-5)
    for a, b in zip(token_params, count_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
