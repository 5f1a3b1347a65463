"""MegatronTeacher in real processes over gloo (TP=2, PP=2) against a `transformers` forward."""
import pytest
import torch

from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import run_distributed

SEQS = [[1, 4, 5, 6, 7], [1, 9, 10], [1, 3, 3, 12, 4, 5, 6, 8, 2]]
TEMPERATURE = 1.5
K = 6


def _score_on_ranks(rank, world_size, model_dir, tp, pp):
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.teacher.megatron_teacher import MegatronTeacher, MegatronTeacherConfig

    init_parallel(ParallelConfig(tp=tp, pp=pp))
    try:
        # a tiny micro-batch budget: the three sequences are packed into two micro-batches
        teacher = MegatronTeacher(model_dir, MegatronTeacherConfig(
            temperature=TEMPERATURE, max_tokens_per_micro_batch=12, offload_between_calls=True))
        dense = teacher.score(SEQS)
        teacher.cfg = MegatronTeacherConfig(k=K, temperature=TEMPERATURE)
        topk = teacher.score(SEQS)
        grads = any(p.requires_grad for p in teacher.engine.parameters())
        return {"dense": [None if d is None else d.logits for d in dense],
                "topk": [None if t is None else (t.ids, t.logprobs) for t in topk],
                "requires_grad": grads, "optimizer": teacher.engine.optimizer}
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = TinyModelShape(num_key_value_heads=2)  # TP=2 splits the KV heads
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("mteacher") / "tiny"), shape=shape, seed=11,
                              init_std=0.1)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0, :-1] / TEMPERATURE for s in SEQS]


def _check_topk(ids, logprobs, ref_logits):
    ref = torch.log_softmax(ref_logits, dim=-1)
    ref_vals, _ = ref.topk(K, dim=-1)
    torch.testing.assert_close(logprobs.double(), ref_vals, atol=1e-4, rtol=0)
    torch.testing.assert_close(ref.gather(1, ids), logprobs.double(), atol=1e-4, rtol=0)


def test_tp2_dense_shards_and_topk_match_transformers(model_dir, reference):
    ranks = run_distributed(_score_on_ranks, 2, model_dir, 2, 1)
    for r in ranks:
        assert r["requires_grad"] is False and r["optimizer"] is None
    for i, ref in enumerate(reference):
        shards = [r["dense"][i] for r in ranks]
        assert shards[0].shape == (len(SEQS[i]) - 1, 128)  # rank r holds ids [128 r, 128 (r+1))
        torch.testing.assert_close(torch.cat(shards, dim=-1).double(), ref, atol=1e-4, rtol=0)
        (ids0, lp0), (ids1, lp1) = ranks[0]["topk"][i], ranks[1]["topk"][i]
        assert torch.equal(ids0, ids1) and torch.equal(lp0, lp1)  # same on every TP rank
        _check_topk(ids0, lp0, ref)


def test_pp2_scores_on_last_stage_only(model_dir, reference):
    first, last = run_distributed(_score_on_ranks, 2, model_dir, 1, 2)
    assert first["dense"] == [None] * len(SEQS) and first["topk"] == [None] * len(SEQS)
    for i, ref in enumerate(reference):
        torch.testing.assert_close(last["dense"][i].double(), ref, atol=1e-4, rtol=0)
        _check_topk(*last["topk"][i], ref)
