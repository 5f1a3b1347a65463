"""A teacher with another tokenizer through the trainer's stages, without engines: the re-tokenizing
scorer, packing, the step loss. With one tokenizer on both sides, `loss.cross_tokenizer: exact`
gives the same-tokenizer step loss and gradient bit for bit."""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.config import LossSection, ParallelSection, load_config
from opkd_mcore.losses import CrossTokenizerTeacher, TopKTeacher, cross_tokenizer_loss
from opkd_mcore.losses.plan import resolve_loss_plan
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from opkd_mcore.rollout import Sample
from opkd_mcore.teacher.base import Teacher, check_sequences
from opkd_mcore.teacher.cross_tokenizer import CrossTokenizerScorer
from opkd_mcore.teacher.remote import RemoteVllmTeacher
from opkd_mcore.teacher.router import TeacherRouter
from opkd_mcore.train.objective import make_loss_fn
from opkd_mcore.train.stages import RolloutBatch, ShardLayout, pack_micro_batches, teacher_stage
from opkd_mcore.train.step_report import rollout_metrics
from opkd_mcore.train.teacher_setup import build_scoring_teacher
from tests._tokenizers import CHARS, char_tokenizer, digit_pair_tokenizer, ids

K = 5


class TableTeacher(Teacher):
    """A deterministic top-k teacher: row t of a sequence depends on tokens t-1 and t (fixed random
    tables), so the same tokens get the same rows whoever asks."""

    def __init__(self, vocab: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * 2
        self.b = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64)
        self.sequences = []

    @property
    def address(self) -> str:
        return "table"

    def score(self, sequences):
        out = []
        for seq in check_sequences(sequences):
            self.sequences.append(seq)
            cur, prev = torch.tensor(seq[:-1]), torch.tensor([seq[0]] + seq[:-2])
            lp, top = torch.log_softmax(self.a[cur] + self.b[prev], dim=-1).topk(K, dim=-1)
            out.append(TopKTeacher(top, lp.float()))
        return out


def _samples(tokenizer, problems):
    out = []
    for i, (prompt, response) in enumerate(problems):
        resp = ids(tokenizer, response) + [tokenizer.eos_token_id]
        out.append(Sample(prompt_ids=list(tokenizer(prompt)["input_ids"]), response_ids=resp,
                          response_logprobs=[-1.0] * len(resp), finish_reason="stop", weight_version=0,
                          group_id=i // 2, data={"prompt": prompt, "messages": None}))
    return out


PROBLEMS = [("07+45=", "250"), ("07+45=", "25"), ("13+9=", "2 20"), ("99+99=", "891")]


def _step(scored, loss: LossSection, logits):
    par = ParallelSection(micro_batch_size=2, global_batch_size=4)
    vocab = logits[0].shape[1]
    batches, counts = pack_micro_batches(scored, par, ShardLayout(vocab_local=vocab, padded_vocab=vocab))
    plan = resolve_loss_plan(loss, device="cpu", dtype=torch.float32, teacher_kind="topk")
    fn = make_loss_fn(plan, counts)
    total, grads, starts = 0.0, [], 0
    for batch in batches:
        z = torch.cat(logits[starts:starts + batch.num_sequences]).clone().requires_grad_()
        starts += batch.num_sequences
        scalar, metrics = fn(z, batch)
        scalar.backward()
        total += scalar.detach()
        grads.append(z.grad)
    return total, torch.cat(grads), metrics


@pytest.mark.parametrize("objective", [dict(divergence="forward_kl", mass="renorm"),
                                       dict(divergence="jsd", beta=0.3, mass="tail", coverage_coef=0.2)])
def test_exact_with_one_tokenizer_is_the_same_tokenizer_step(objective):
    tok = char_tokenizer()
    samples = _samples(tok, PROBLEMS)
    teacher = TableTeacher(len(tok))
    same = teacher_stage(teacher, _rollout(samples))
    cross = teacher_stage(CrossTokenizerScorer(teacher, tok, char_tokenizer()), _rollout(samples))
    assert teacher.sequences[:4] == teacher.sequences[4:]   # the teacher read the same sequences
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(len(s.sequence), len(tok), generator=gen) * 2 for s in samples]
    base = LossSection(support="teacher", **objective)
    want = _step(same, base, logits)
    got = _step(cross, LossSection(support="teacher", cross_tokenizer="exact", **objective), logits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2]["xtok/exact_rows"] > 0 and got[2]["xtok/uld_rows"] == 0


def _rollout(samples):
    return RolloutBatch(samples=samples)


def test_digit_pair_teacher_through_the_stages():
    """The teacher reads its own prompt and the response in digit pairs; the packed step's loss is
    the per-sample cross-tokenizer loss, and agreement is measured on the exact spans."""
    s_tok, t_tok = char_tokenizer(), digit_pair_tokenizer()
    samples = _samples(s_tok, PROBLEMS)
    teacher = TableTeacher(len(t_tok), seed=3)
    scorer = CrossTokenizerScorer(teacher, s_tok, t_tok)
    scored = teacher_stage(scorer, _rollout(samples))
    # its prompt as its tokenizer writes it (no BOS: it adds none), the response in digit pairs
    assert [t_tok.convert_ids_to_tokens(seq) for seq in teacher.sequences[:2]] == [
        ["07", "+", "45", "=", "25", "0", "<|endoftext|>"], ["07", "+", "45", "=", "25", "<|endoftext|>"]]
    assert all(isinstance(t, CrossTokenizerTeacher) and t.num_rows == len(s.sequence)
               for s, t in zip(samples, scored.teacher))
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(len(s.sequence), len(s_tok), generator=gen, dtype=torch.float64) for s in samples]
    loss = LossSection(support="teacher", cross_tokenizer="gold", gold_exact_weight=0.5, gold_uld_weight=2.0,
                       mass="tail")
    total, _, metrics = _step(scored, loss, [z.float() for z in logits])
    want, tokens = 0.0, sum(len(s.response_ids) for s in samples)
    for s, t, z in zip(samples, scored.teacher, logits):
        per_row, _ = cross_tokenizer_loss(z, t, torch.tensor(s.sequence[1:] + [0]), t.teacher_to_student,
                                          mode="gold", mass="tail", exact_weight=0.5, uld_weight=2.0,
                                          impl="reference")
        want += float(per_row.sum()) / tokens
    assert float(total) == pytest.approx(want, rel=1e-5)
    assert 0 < metrics["xtok/uld_rows"] and 0 < metrics["xtok/exact_rows"]
    report = rollout_metrics(scored)
    assert 0.0 <= report["teacher/top1_agreement"] <= 1.0


def test_the_run_wraps_its_one_teacher(tmp_path):
    """`build_scoring_teacher` across tokenizers: the wrapper around a remote teacher (probed for the
    teacher's own ids, replicas routed), or around nothing for a megatron teacher in the step."""
    shape = TinyModelShape(vocab_size=160, hidden_size=32, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, intermediate_size=32)
    student = save_tiny_hf_model(str(tmp_path / "s"), "qwen3", shape, alphabet=CHARS)
    teacher = save_tiny_hf_model(str(tmp_path / "t"), "qwen3", shape, tokenizer=digit_pair_tokenizer())
    base = [f"model.student={student}", f"teacher.teachers.0.model={teacher}", "loss.support=teacher",
            "loss.cross_tokenizer=exact"]
    remote = [*base, "teacher.teachers.0.backend=remote", "teacher.teachers.0.url=http://127.0.0.1:9"]
    scorer = build_scoring_teacher(load_config(None, remote, validate=False))
    assert isinstance(scorer, CrossTokenizerScorer) and isinstance(scorer.teacher, RemoteVllmTeacher)
    assert scorer.teacher.cfg.student_vocab_size == len(digit_pair_tokenizer())
    assert scorer.teacher.cfg.tokenizer_of == "teacher"
    with_replica = [*remote, "teacher.teachers.0.replica_urls=[http://h:1]"]
    replicas = build_scoring_teacher(load_config(None, with_replica, validate=False))
    assert isinstance(replicas.teacher, TeacherRouter)
    megatron = [*base, "teacher.teachers.0.backend=megatron", "loss.k=4"]
    in_step = build_scoring_teacher(load_config(None, megatron, validate=False))
    assert isinstance(in_step, CrossTokenizerScorer) and in_step.teacher is None
    scored = in_step.score_rollout(_samples(char_tokenizer(), PROBLEMS[:1]))
    t_tok = digit_pair_tokenizer()
    assert scored[0].rows is None   # filled in the step
    assert scored[0].tokens.tolist() == ids(t_tok, "07+45=") + ids(t_tok, "250") + [t_tok.eos_token_id]


def test_a_server_refusing_the_teachers_ids_names_the_teachers_tokenizer():
    """Across tokenizers the requests carry the teacher tokenizer's ids: a server with a smaller
    vocabulary is refused naming that tokenizer's key, not the student's."""
    from opkd_mcore.teacher.base import TeacherError
    from opkd_mcore.teacher.remote import RemoteTeacherConfig
    from tests.test_teacher_remote import fake_server

    with fake_server(vocab_size=100) as (url, _):
        client = RemoteVllmTeacher(RemoteTeacherConfig(url=url, k=4, student_vocab_size=144, max_retries=0,
                                                       tokenizer_of="teacher"))
        with pytest.raises(TeacherError, match=rf"{url}: its vocabulary has 100 token ids, the teacher "
                                               r"tokenizer .*\(teacher.teachers.0.model\) has 144"):
            client.check_server()
