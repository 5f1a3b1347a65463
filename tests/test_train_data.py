"""Prompt data: the synthetic addition task, file datasets, and the resumable sampler."""
import json

import pytest

from opkd_mcore.config import DataSection
from opkd_mcore.data import AdditionTask, PromptDataset, PromptSampler, build_datasets, exact_match


@pytest.mark.parametrize("digits, reverse, num_train", [(1, True, 80), (2, True, 200), (3, False, 200)])
def test_addition_answers_are_the_sums(digits, reverse, num_train):
    task = AdditionTask(digits, reverse_answer=reverse)
    train, held_out = task.splits(num_train, 20, seed=3)
    for r in train + held_out:
        a, b = r["prompt"].rstrip("=").split("+")
        assert len(a) == len(b) == digits
        answer = r["answer"][::-1] if reverse else r["answer"]
        assert int(answer) == int(a) + int(b), r
        assert len(r["answer"]) == digits + 1
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert task.splits(num_train, 20, seed=3) == (train, held_out)  # deterministic


def test_addition_rejects_more_problems_than_exist():
    with pytest.raises(ValueError, match="num_train \\+ num_eval"):
        AdditionTask(1).splits(90, 20)


def test_exact_match():
    assert exact_match(" 250 ", "250") == 1.0
    assert exact_match("25", "250") == 0.0
    assert exact_match("2500", "250") == 0.0


def test_sampler_resumes_exactly():
    full = PromptSampler(10, 4, seed=5)
    expected = [full.next_batch() for _ in range(7)]  # crosses epochs (10 is not a multiple of 4)
    first = PromptSampler(10, 4, seed=5)
    got = [first.next_batch() for _ in range(3)]
    resumed = PromptSampler(10, 4, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.next_batch() for _ in range(4)]
    assert got == expected
    # each epoch is a permutation, and epochs differ
    flat = [i for batch in expected for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and flat[:10] != flat[10:20]


def test_jsonl_and_parquet_datasets(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i), "data_source": "math" if i % 2 else "code"}
            for i in range(5)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = PromptDataset.from_file(str(jsonl), prompt_key="question")
    assert len(ds) == 5 and ds.prompt(3) == "q3" and ds.answer(3) == "3" and ds.data_source(3) == "math"
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    train, held = build_datasets(DataSection(train_path=str(tmp_path / "p.parquet"), prompt_key="question",
                                             eval_path=str(jsonl)))
    assert [train.prompt(i) for i in range(5)] == [ds.prompt(i) for i in range(5)] and len(held) == 5
    with pytest.raises(ValueError, match='has neither a prompt field "prompt"'):
        PromptDataset.from_file(str(jsonl))


def test_synthetic_datasets_from_config():
    train, held = build_datasets(DataSection(task="addition", task_digits=2, num_train=300, num_eval=40))
    assert len(train) == 300 and len(held) == 40
    assert train.data_source(0) == "addition"


# ---------------------------------------------------------------- task rewards
def reward_for_test(response: str, data: dict) -> float:
    """A pluggable reward (`data.rewards: {src: "tests.test_train_data:reward_for_test"}`)."""
    return float(len(response))


def test_task_rewards_by_data_source_and_group_advantages():
    import math

    from opkd_mcore.data.rewards import TaskRewards, group_advantages

    rewards = TaskRewards({"len": "tests.test_train_data:reward_for_test"})
    assert rewards.score("abc", {"data_source": "len"}) == 3.0
    assert rewards.score(" 250", {"data_source": "addition", "answer": "250"}) == 1.0  # default: exact match
    with pytest.raises(ValueError, match="'code' has no answer"):
        rewards.score("x", {"data_source": "code"})
    with pytest.raises(ValueError, match="data.rewards.bad: cannot import 'nowhere:fn'"):
        TaskRewards({"bad": "nowhere:fn"})
    adv = group_advantages([1.0, 0.0, 1.0, 0.5, 0.5], [0, 0, 0, 1, 1])
    mean, std = 2 / 3, math.sqrt(2 / 9)
    assert adv[:3] == pytest.approx([(1 - mean) / std, -mean / std, (1 - mean) / std], rel=1e-5)
    assert adv[3:] == [0.0, 0.0]  # equal rewards in a group: nothing to prefer


# ---------------------------------------------------------------- prompts as token ids
@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from opkd_mcore.models.tiny import save_tiny_hf_model

    out = save_tiny_hf_model(str(tmp_path_factory.mktemp("tok") / "m"), seed=0, alphabet="0123456789+= abc")
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    return tok


def test_prompts_are_encoded_as_the_tokenizer_does_and_chats_through_the_template(chat_tokenizer):
    from opkd_mcore.data import encode_prompt, encode_record

    tok = chat_tokenizer
    assert encode_prompt(tok, "12+3=") == tok("12+3=")["input_ids"] and encode_prompt(tok, "1")[0] == tok.bos_token_id
    ds = PromptDataset([{"prompt": "1+2="}, {"messages": [{"role": "user", "content": "1+2"}]}])
    chat = tok.apply_chat_template([{"role": "user", "content": "1+2"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert encode_record(tok, ds, 0) == tok("1+2=")["input_ids"]
    assert encode_record(tok, ds, 1) == list(chat)
    assert ds.prompt(1) == "1+2"
    wrapped = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert encode_record(tok, ds, 0, "always") == list(wrapped)
    with pytest.raises(ValueError, match="dataset: record 1: has chat messages .* 'none'"):
        encode_record(tok, ds, 1, "none")
    tok.chat_template = None
    with pytest.raises(ValueError, match="need a chat template"):
        encode_record(tok, ds, 1)
    with pytest.raises(ValueError, match='field "messages": expected a non-empty list'):
        PromptDataset([{"messages": "hi"}])
