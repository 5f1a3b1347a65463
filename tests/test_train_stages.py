"""Trainer stages without engines: packing teacher rows, DP slicing, the step loss, metrics files."""
import math

import pytest
import torch

from opkd_mcore.config import LoggingSection, LossSection, ParallelSection
from opkd_mcore.losses import DenseTeacher, TopKTeacher
from opkd_mcore.losses.plan import resolve_loss_plan
from opkd_mcore.rollout import Sample
from opkd_mcore.train.metrics import MetricsLogger, read_jsonl
from opkd_mcore.train.objective import StepCounts, make_loss_fn
from opkd_mcore.train.stages import ScoredBatch, ShardLayout, pack_micro_batches
from opkd_mcore.train.step_report import rollout_metrics

V, K = 11, 3


def _scored(num=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples, rows = [], []
    for i in range(num):
        prompt = torch.randint(0, V, (2 + i % 2,), generator=g).tolist()
        response = torch.randint(0, V, (1 + i,), generator=g).tolist()
        samples.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-1.0] * len(response),
                              finish_reason="stop", weight_version=0, group_id=i // 2))
        n = len(prompt) + len(response) - 1
        logits = torch.randn(n, V, generator=g, dtype=torch.float64)
        lp, ids = torch.log_softmax(logits, -1).topk(K, -1)
        rows.append(TopKTeacher(ids=ids, logprobs=lp.float()))
    return ScoredBatch(samples=samples, teacher=rows)


def test_pack_aligns_teacher_rows_and_slices_dp():
    scored = _scored()
    par = ParallelSection(micro_batch_size=1, global_batch_size=4)
    batches, counts = pack_micro_batches(scored, par, ShardLayout(dp_rank=1, dp_size=2, vocab_local=V,
                                                                  padded_vocab=V))
    assert counts == StepCounts(num_tokens=sum(len(s.response_ids) for s in scored.samples), num_seqs=4)
    assert len(batches) == 2  # this DP rank's 2 sequences, one per micro-batch
    for batch, i in zip(batches, (2, 3)):
        sample, rows = scored.samples[i], scored.teacher[i]
        assert batch.tokens.tolist() == sample.sequence
        assert torch.equal(batch.teacher.ids[:-1], rows.ids)  # row t scores token t+1
        assert (batch.teacher.ids[-1] == -1).all() and torch.isinf(batch.teacher.logprobs[-1]).all()
        assert batch.loss_mask.sum() == len(sample.response_ids)


def test_dense_full_vocab_teacher_is_cut_to_the_tp_shard():
    scored = _scored(num=2)
    dense = [DenseTeacher(logits=torch.randn(t.ids.shape[0], V)) for t in scored.teacher]
    scored = ScoredBatch(samples=scored.samples, teacher=dense)
    par = ParallelSection(micro_batch_size=2, global_batch_size=2)
    padded = 12  # V=11 padded to 2 x 6
    (batch,), _ = pack_micro_batches(scored, par, ShardLayout(tp_rank=1, vocab_local=6, padded_vocab=padded))
    first = dense[0].logits
    assert torch.equal(batch.teacher.logits[:first.shape[0], :5], first[:, 6:])
    assert (batch.teacher.logits[:first.shape[0], 5] == -1.0e4).all()  # the padded vocabulary column


def _brute_force_renorm_kl(scored, student_logits_rows):
    """float64 reference: Σ over response positions of KL(p_S/m_p || q_S/m_q), per token."""
    total = 0.0
    for sample, rows, z in zip(scored.samples, scored.teacher, student_logits_rows):
        start = len(sample.prompt_ids) - 1
        for t in range(start, start + len(sample.response_ids)):
            ids = rows.ids[t]
            p = rows.logprobs[t].double().exp()
            p = p / p.sum()
            q = torch.softmax(z[t].double(), -1)[ids]
            q = q / q.sum()
            total += float((p * (p.log() - q.log())).sum())
    return total


def test_step_loss_matches_float64_reference_and_is_micro_batch_invariant():
    scored = _scored(num=4, seed=1)
    g = torch.Generator().manual_seed(2)
    student = [torch.randn(len(s.sequence), V, generator=g) for s in scored.samples]
    loss_cfg = LossSection(support="teacher")
    expected = _brute_force_renorm_kl(scored, student)
    tokens = sum(len(s.response_ids) for s in scored.samples)
    results = {}
    for mbs in (1, 4):
        par = ParallelSection(micro_batch_size=mbs, global_batch_size=4)
        batches, counts = pack_micro_batches(scored, par, ShardLayout(vocab_local=V, padded_vocab=V))
        plan = resolve_loss_plan(loss_cfg, device="cpu", dtype=torch.float32, teacher_kind="topk")
        loss_fn = make_loss_fn(plan, counts)
        total, start = 0.0, 0
        for batch in batches:
            logits = torch.cat(student[start:start + batch.num_sequences])
            start += batch.num_sequences
            value, metrics = loss_fn(logits.requires_grad_(), batch)
            total += float(value)
        results[mbs] = total
    assert results[1] == pytest.approx(expected / tokens, rel=1e-5)
    assert results[4] == pytest.approx(results[1], rel=1e-6)


def test_rollout_metrics():
    scored = _scored(num=2)
    sample = scored.samples[1]
    start = len(sample.prompt_ids) - 1
    top1 = scored.teacher[1].ids[start:start + len(sample.response_ids), 0].tolist()
    sample.response_ids = top1  # the student picked the teacher's favourite at every position
    m = rollout_metrics(scored)
    first = scored.samples[0]
    first_agree = int(scored.teacher[0].ids[len(first.prompt_ids) - 1, 0]) == first.response_ids[0]
    assert m["teacher/top1_agreement"] == pytest.approx((len(top1) + first_agree) / (len(top1) + 1))
    assert m["rollout/response_len_mean"] == (1 + len(top1)) / 2 and m["rollout/stop_fraction"] == 1.0


def test_metrics_jsonl_is_cut_back_on_resume(tmp_path):
    cfg = LoggingSection(progress_bar=False, console_every=0)
    log = MetricsLogger(str(tmp_path), cfg, 5)
    for step in range(4):
        log.log(step, {"train/loss": float(step)})
    log.close()
    log = MetricsLogger(str(tmp_path), cfg, 5, start_step=2)  # resumed from a step-2 checkpoint
    log.log(2, {"train/loss": 20.0})
    log.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["train/loss"] == 20.0
    assert all(not math.isnan(r["train/loss"]) for r in rows)


def _pg_worker(rank, world):
    """The policy-gradient form against a hand-written float64 PPO-clip k3 reference (TP=1)."""
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (before the CPU emulation)

    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig())
    try:
        scored = _scored(num=3, seed=4)
        par = ParallelSection(micro_batch_size=3, global_batch_size=3)
        (batch,), counts = pack_micro_batches(scored, par, ShardLayout(vocab_local=V, padded_vocab=V))
        g = torch.Generator().manual_seed(5)
        logits = torch.randn(batch.num_tokens, V, generator=g)
        batch.sampler_logprobs = batch.sampler_logprobs - 0.1 * batch.loss_mask  # ratio != 1
        cfg = LossSection(form="policy_gradient", kl_estimator="k3", pg_coef=0.5, clip_eps=0.2,
                          support="teacher")
        # a clone: like Megatron's cross entropy, the loss may consume the logits buffer in place
        plan = resolve_loss_plan(cfg, device="cpu", dtype=torch.float32, teacher_kind="topk")
        value, _ = make_loss_fn(plan, counts)(logits.clone(), batch)
        expected, start = 0.0, 0
        for sample, rows in zip(scored.samples, scored.teacher):
            p0 = len(sample.prompt_ids) - 1
            for t, token in enumerate(sample.response_ids):
                pos = p0 + t
                log_q = torch.log_softmax(logits[start + pos].double(), -1)[token]
                hit = (rows.ids[pos] == token).nonzero()
                log_p = (rows.logprobs[pos, hit[0, 0]].double() if len(hit)
                         else rows.logprobs[pos].min().double() - math.log(2.0))
                delta = log_p - log_q
                advantage = -0.5 * (torch.exp(delta) - delta - 1)
                ratio = torch.exp(log_q - batch.sampler_logprobs[start + pos].double())
                expected += float(torch.maximum(-advantage * ratio,
                                                -advantage * ratio.clamp(0.8, 1.2)))
            start += len(sample.sequence)
        return float(value), expected / counts.num_tokens
    finally:
        destroy_parallel()


def test_policy_gradient_form_matches_reference():
    from tests._dist import run_distributed

    (got, expected), = run_distributed(_pg_worker, 1)
    assert got == pytest.approx(expected, rel=1e-5)
