"""The teacher's own prompt per record (privileged context): read and checked with the data, tokenised
as the student's prompt is, and paired with the student's sequence at each response token.

The pairing is checked against a float64 reference computed by hand: a `transformers` forward of
teacher prompt + response, whose rows at the response positions must land on the student's rows that
predict the same tokens (a teacher prompt longer and one shorter than the student's), with every
other student row padding and the step's loss the hand-computed KL over response tokens only.
"""
import json
import math

import pytest
import torch

from opkd_mcore.config import (
    ConfigError,
    DataSection,
    LossSection,
    ParallelSection,
    RolloutSection,
    TrainConfig,
    load_config,
)
from opkd_mcore.config.validate import _check_teacher_prompts
from opkd_mcore.data import DataError, build_datasets, build_train_set
from opkd_mcore.data.teacher_prompts import TeacherPrompts, encode_teacher_prompt
from opkd_mcore.engine.response_pairing import gather_rows, packed_response_index, response_row_index
from opkd_mcore.losses import HiddenTeacher, TopKTeacher
from opkd_mcore.losses.plan import resolve_loss_plan
from opkd_mcore.models.tiny import TinyModelShape, make_char_tokenizer, save_tiny_hf_model
from opkd_mcore.rollout import Sample
from opkd_mcore.train.objective import StepCounts, make_loss_fn
from opkd_mcore.train.stages import RolloutBatch, ScoredBatch, ShardLayout, pack_micro_batches, teacher_stage

ALPHABET = "0123456789+=|abc "


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_char_tokenizer(ALPHABET)  # one token per character, plus <bos>
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    return tok


def write_rows(tmp_path, rows, name: str = "d.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- data: where teacher prompts come from
def test_template_and_key_teacher_prompts_are_tokenised_as_the_student_prompt(tmp_path, tokenizer):
    rows = [{"prompt": "1+2=", "answer": "3"},
            {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "2+2="},
                          {"role": "assistant", "content": "b"}, {"role": "user", "content": "4+4="}],
             "answer": 8}]
    train, _ = build_datasets(DataSection(train_path=write_rows(tmp_path, rows)))
    template = TeacherPrompts(template="{answer}|{prompt}")
    # a text record: the text raw, as the student's text prompt is
    assert encode_teacher_prompt(tokenizer, train, 0, template) == tokenizer("3|1+2=")["input_ids"]
    # "always": one user turn, as the student's prompt would be
    assert encode_teacher_prompt(tokenizer, train, 0, template, "always") == tokenizer.apply_chat_template(
        [{"role": "user", "content": "3|1+2="}], add_generation_prompt=True, tokenize=True, return_dict=False)
    # a chat record: {prompt} is its last user message, and the text takes that turn's place
    chat = encode_teacher_prompt(tokenizer, train, 1, template)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "a"}, {"role": "user", "content": "2+2="},
         {"role": "assistant", "content": "b"}, {"role": "user", "content": "8|4+4="}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat == expected
    # a field holding chat messages: through the chat template as they are
    rows = [{"prompt": "1+2=", "hint": [{"role": "user", "content": "3|1+2="}]},
            {"prompt": "1+1=", "hint": "2|"}]
    train, _ = build_datasets(DataSection(train_path=write_rows(tmp_path, rows)))
    key = TeacherPrompts(key="hint")
    assert encode_teacher_prompt(tokenizer, train, 0, key) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "3|1+2="}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert encode_teacher_prompt(tokenizer, train, 1, key) == tokenizer("2|")["input_ids"]
    with pytest.raises(ValueError, match="d.jsonl:1: teacher prompt: chat messages, but data.chat_template"):
        encode_teacher_prompt(tokenizer, train, 0, key, "none")


def test_records_without_a_teacher_prompt_are_named_or_skipped(tmp_path, tokenizer):
    rows = [{"prompt": "1+2=", "solution": "3"}, {"prompt": "1+1="}, {"prompt": "2+2=", "solution": None},
            {"prompt": "2+3=", "solution": "5"}]
    path = write_rows(tmp_path, rows)
    data = DataSection(train_path=path, teacher_prompt_template="{prompt}{solution}|")
    with pytest.raises(DataError) as err:
        build_train_set(TrainConfig(data=data), tokenizer)
    assert str(err.value).splitlines()[:2] == [
        f'data.train_path: {path}:2: field "solution" (of data.teacher_prompt_template): missing',
        f'data.train_path: {path}:3: field "solution" (of data.teacher_prompt_template): missing']
    data.missing_teacher_prompt = "skip"
    kept, skipped = build_train_set(TrainConfig(data=data), tokenizer)
    assert [kept.prompt(i) for i in range(len(kept))] == ["1+2=", "2+3="]
    assert [s.to_dict() for s in skipped] == [
        {"index": 1, "location": f"{path}:2",
         "problem": 'field "solution" (of data.teacher_prompt_template): missing'},
        {"index": 2, "location": f"{path}:3",
         "problem": 'field "solution" (of data.teacher_prompt_template): missing'}]
    key = DataSection(train_path=write_rows(tmp_path, [{"prompt": "1", "hint": 3}], "k.jsonl"),
                      teacher_prompt_key="hint")
    with pytest.raises(DataError, match=r'k.jsonl:1: field "hint": expected a string or chat messages, got a '
                                        r'number \(3\)'):
        build_train_set(TrainConfig(data=key), tokenizer)
    # the teacher prompt is measured against the rollout's context too
    long = DataSection(train_path=path, missing_teacher_prompt="skip",
                       teacher_prompt_template="{prompt}{solution}|{solution}{solution}{solution}")
    with pytest.raises(DataError, match=r"d.jsonl:1: teacher prompt of 10 tokens leaves no room"):
        build_train_set(TrainConfig(data=long, rollout=RolloutSection(max_model_len=12, max_new_tokens=4)),
                        tokenizer)


@pytest.mark.parametrize("data, match", [
    (dict(teacher_prompt_key="hint", teacher_prompt_template="{x}"),
     "^data.teacher_prompt_template: set either"),
    (dict(teacher_prompt_template="{0}"),
     r"^data.teacher_prompt_template: field \{0\}: expected a record field"),
    (dict(teacher_prompt_template="{a.b}"), r"^data.teacher_prompt_template: field \{a.b\}"),
    (dict(teacher_prompt_template="{x"), "^data.teacher_prompt_template: not a str.format template"),
    (dict(teacher_prompt_template="the same text"), "^data.teacher_prompt_template: names no record field"),
    (dict(teacher_prompt_key=" "), "^data.teacher_prompt_key: expected a non-empty string"),
    (dict(missing_teacher_prompt="drop"), "^data.missing_teacher_prompt: expected one of"),
])
def test_teacher_prompt_options_are_checked(data, match):
    with pytest.raises(ConfigError, match=match):
        _check_teacher_prompts(DataSection(**data))


def test_the_options_load_from_dotted_overrides():
    cfg = load_config(None, ["data.teacher_prompt_template='{answer}|{prompt}'",
                             "data.missing_teacher_prompt=skip"], validate=False)
    assert cfg.data.teacher_prompt_template == "{answer}|{prompt}"
    assert cfg.data.missing_teacher_prompt == "skip"


# ---------------------------------------------------------------- pairing rows by response token
def test_row_index_pairs_each_response_token_and_pads_the_rest():
    assert response_row_index(3, 5, 2).tolist() == [-1, -1, 4, 5]
    assert response_row_index(4, 1, 2).tolist() == [-1, -1, -1, 0, 1]
    # packed: every position of each sequence (its last one has no pair), teacher rows offset by its packing
    assert packed_response_index([2, 3], [4, 1], [2, 2]).tolist() == [-1, 3, 4, -1, -1, -1, 6, 7, -1]
    with pytest.raises(ValueError, match="expected >= 1"):
        response_row_index(0, 2, 1)
    hidden = HiddenTeacher(hidden=torch.arange(6.0).reshape(3, 2), weight=torch.ones(4, 2), vocab_size=3)
    paired = gather_rows(hidden, torch.tensor([-1, 2, 0]))
    assert paired.hidden.tolist() == [[0.0, 0.0], [4.0, 5.0], [0.0, 1.0]] and paired.weight is hidden.weight
    rows = TopKTeacher(ids=torch.tensor([[1, 2], [3, -1]]),
                       logprobs=torch.tensor([[-0.1, -2.0], [0.0, -math.inf]]))
    topk = gather_rows(rows, torch.tensor([1, -1]))
    assert topk.ids.tolist() == [[3, -1], [-1, -1]] and torch.isinf(topk.logprobs[1]).all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = TinyModelShape(vocab_size=24, hidden_size=32, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=48, max_position_embeddings=64)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tp") / "m"), "qwen3", shape, seed=3,
                              alphabet=ALPHABET, init_std=0.3)


def _samples():
    """Two samples of one prompt, a teacher prompt longer (7 > 3) and one shorter (2 < 5)."""
    def sample(prompt, teacher_prompt, response, group):
        return Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-1.0] * len(response),
                      finish_reason="stop", weight_version=0, group_id=group,
                      teacher_prompt_ids=teacher_prompt)
    return [sample([1, 4, 5], [1, 9, 9, 12, 4, 5, 13], [6, 7, 8, 2], 0),
            sample([1, 7, 7, 8, 13], [1, 11], [3, 4, 2], 1)]


@torch.no_grad()
def _reference_logprobs(model_dir, sample) -> torch.Tensor:
    """By hand, float64: the teacher's log-probabilities at the positions of `teacher prompt + response`
    that predict response tokens 0..R-1 ([R, V])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    seq = sample.teacher_prompt_ids + sample.response_ids
    logits = model(torch.tensor([seq])).logits[0]
    p_t = len(sample.teacher_prompt_ids)
    return torch.log_softmax(logits[p_t - 1:p_t - 1 + len(sample.response_ids)], -1)


def test_a_teacher_prompt_of_another_length_scores_exactly_the_response_tokens(model_dir):
    from opkd_mcore.teacher.hf_teacher import TransformersTeacher

    samples = _samples()
    dense = teacher_stage(TransformersTeacher(model_dir, k=None, dtype=torch.float64), RolloutBatch(samples))
    topk = teacher_stage(TransformersTeacher(model_dir, k=5, dtype=torch.float64), RolloutBatch(samples))
    for s, d, t in zip(samples, dense.teacher, topk.teacher):
        ref = _reference_logprobs(model_dir, s)
        p_s, r = len(s.prompt_ids), len(s.response_ids)
        assert d.logits.shape[0] == len(s.sequence) - 1  # the student's layout
        response = d.logits[p_s - 1:].double()
        torch.testing.assert_close(torch.log_softmax(response, -1), ref, rtol=0, atol=2e-6)
        assert (d.logits[:p_s - 1] == 0).all()  # student prompt rows: padding, never scored
        values, ids = ref.topk(5, -1)
        assert torch.equal(t.ids[p_s - 1:], ids)
        torch.testing.assert_close(t.logprobs[p_s - 1:].double(), values, rtol=0, atol=2e-6)
        assert (t.ids[:p_s - 1] == -1).all() and torch.isinf(t.logprobs[:p_s - 1]).all()
        # the student's response token j is the token the paired teacher row predicts
        assert [s.sequence[p_s + j] for j in range(r)] == s.response_ids

    # the step's loss covers the response tokens only: forward KL summed over them, by hand in float64
    v = dense.teacher[0].logits.shape[1]
    par = ParallelSection(micro_batch_size=2, global_batch_size=2)
    shard = ShardLayout(vocab_local=v, padded_vocab=v)
    (batch,), counts = pack_micro_batches(dense, par, shard)
    student = torch.randn(batch.num_tokens, v, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(0))
    plan = resolve_loss_plan(LossSection(impl="reference"), device="cpu", dtype=torch.float64,
                             teacher_kind="dense")
    loss, _ = make_loss_fn(plan, counts)(student, batch)
    expected, start = 0.0, 0
    for s in samples:
        p_s, r = len(s.prompt_ids), len(s.response_ids)
        p = _reference_logprobs(model_dir, s).exp()
        q = torch.log_softmax(student[start + p_s - 1:start + p_s - 1 + r], -1)
        expected += (p * (p.log() - q)).sum()
        start += len(s.sequence)
    assert counts == StepCounts(num_tokens=7, num_seqs=2)
    assert float(loss) == pytest.approx(float(expected) / 7, rel=1e-6)


def test_an_in_step_teacher_gets_its_own_packing_and_the_pairing_index(model_dir):
    samples = _samples()
    scored = ScoredBatch(samples=samples, teacher=[None, None])  # scored inside the step
    par = ParallelSection(micro_batch_size=2, global_batch_size=2)
    (batch,), _ = pack_micro_batches(scored, par, ShardLayout(vocab_local=24, padded_vocab=24))
    assert batch.teacher is None
    assert batch.teacher_tokens.tokens.tolist() == samples[0].teacher_sequence + samples[1].teacher_sequence
    index = batch.teacher_index
    rows = torch.nonzero(batch.loss_mask).squeeze(1)
    assert torch.equal(torch.nonzero(index >= 0).squeeze(1), rows)  # exactly the scored rows are paired
    # row t predicts token t+1; its teacher row predicts the same token in the teacher's packing
    assert torch.equal(batch.tokens[rows + 1], batch.teacher_tokens.tokens[index[rows] + 1])


def test_the_ray_prompt_queue_keeps_each_prompts_teacher_prompt_across_a_checkpoint():
    from opkd_mcore.controller.data_plane import PromptQueue
    from opkd_mcore.data import PromptSampler
    from opkd_mcore.train.stages import PromptBatch

    def draw(indices, number):
        return PromptBatch(indices=list(indices), prompt_ids=[[1, 3 + i] for i in indices],
                           data=[{}] * len(indices), seeds=list(range(len(indices))),
                           teacher_prompt_ids=[[1, 9, 3 + i] for i in indices])

    queue = PromptQueue(draw, PromptSampler(5, 2, seed=0), 5, 2)
    jobs = queue.take(3)
    assert all(j.teacher_prompt_ids == [1, 9, 3 + j.prompt_index] for j in jobs)
    restored = PromptQueue(draw, PromptSampler(5, 2, seed=0), 5, 2)
    restored.load_state_dict(queue.state_dict())

    def teacher_prompts(q):
        return {key: job.teacher_prompt_ids for key, job in q.outstanding.items()}
    assert teacher_prompts(restored) == teacher_prompts(queue) and len(teacher_prompts(queue)) == 4
