"""Data files are read and checked before any engine starts: every bad row is named by file, line
(or record / row index) and field; prompts that leave no room for the response are refused (or
skipped and counted with `data.overlong: skip`)."""
import json
import logging

import pytest

from opkd_mcore.config import DataSection, ModelSection, RolloutSection, RunSection, TrainConfig
from opkd_mcore.data import (
    DataError,
    Overlong,
    PromptDataset,
    build_datasets,
    build_train_set,
    check_prompt_lengths,
    drop_overlong,
)
from opkd_mcore.models.tiny import make_char_tokenizer
from opkd_mcore.train.samples_log import audit, audit_run, read_skipped, write_skipped

ALPHABET = "0123456789+= abc"


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def error_lines(err) -> list[str]:
    return str(err.value).splitlines()


# ---------------------------------------------------------------- reading files
def test_jsonl_syntax_error_names_the_file_and_its_line(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", ['{"prompt": "1+1="}', "", '{"prompt": "2+2=",}',
                                              '{"prompt": "3+3="}', '{"prompt": 4'])
    with pytest.raises(DataError) as err:
        build_datasets(DataSection(train_path=path))
    assert error_lines(err) == [
        f"data.train_path: {path}:3: invalid JSON: Expecting property name enclosed in double quotes "
        "(column 19)",
        f"data.train_path: {path}:5: invalid JSON: Expecting ',' delimiter (column 13)",
    ]


def test_json_list_syntax_error_names_the_line_and_rows_name_the_record(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('[\n  {"prompt": "1+1="},\n  {"prompt": "2+2="\n]\n')
    with pytest.raises(DataError, match=rf"^data.train_path: {path}:4: invalid JSON: Expecting ','"):
        build_datasets(DataSection(train_path=str(path)))
    path.write_text(json.dumps([{"prompt": "1+1="}, {"prompt": None}, "3+3="]))
    with pytest.raises(DataError) as err:
        build_datasets(DataSection(train_path=str(path)))
    assert error_lines(err) == [
        f'data.train_path: {path}: record 1: field "prompt": expected a string, got null',
        f"data.train_path: {path}: record 2: expected an object with a 'prompt' or 'messages' field, "
        "got a string ('3+3=')",
    ]
    path.write_text('{"prompt": "1+1="}')
    with pytest.raises(DataError, match="expected a JSON list of objects, got an object"):
        build_datasets(DataSection(train_path=str(path)))


def test_every_bad_row_is_named_with_its_line_and_field_up_to_a_cap(tmp_path):
    bad = ['{"prompt": null}', '{"prompt": 7}', '{"prompt": ["a", "b"]}', '"just a string"', "42",
           '{"question": "1+1="}', '{"prompt": "1+1=", "answer": 0.5}', '{"prompt": "1+1=", "answer": true}',
           '{"prompt": "1+1=", "data_source": 3}', '{"messages": null}', '{"prompt": {}}', '{"prompt": 1.5}',
           "null"]
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "0+0=", "answer": 42}', *bad])
    eval_path = write_lines(tmp_path / "ok.jsonl", ['{"prompt": "1+1="}'])
    with pytest.raises(DataError) as err:
        build_datasets(DataSection(train_path=path, eval_path=eval_path))
    lines = error_lines(err)
    assert lines[:5] == [
        f'data.train_path: {path}:2: field "prompt": expected a string, got null',
        f'data.train_path: {path}:3: field "prompt": expected a string, got a number (7)',
        f'data.train_path: {path}:4: field "prompt": expected a string, got a list of 2',
        f"data.train_path: {path}:5: expected an object with a 'prompt' or 'messages' field, "
        "got a string ('just a string')",
        f"data.train_path: {path}:6: expected an object with a 'prompt' or 'messages' field, "
        "got a number (42)",
    ]
    assert lines[5] == (f'data.train_path: {path}:7: has neither a prompt field "prompt" nor chat messages '
                        "\"messages\" (fields: ['question'])")
    assert lines[6:10] == [
        f'data.train_path: {path}:8: field "answer": expected a string (or an integer), got a number (0.5)',
        f'data.train_path: {path}:9: field "answer": expected a string (or an integer), got a boolean (true)',
        f'data.train_path: {path}:10: field "data_source": expected a string, got a number (3)',
        f'data.train_path: {path}:11: field "messages": expected a non-empty list of messages, got null',
    ]
    assert lines[10:] == ["data.train_path: ... and 3 more (13 problems in all)"]
    assert len(err.value.problems) == 13
    assert err.value.problems[-1].startswith(f"{path}:14: expected an object")


def test_the_held_out_file_is_checked_under_its_own_key(tmp_path):
    train = write_lines(tmp_path / "t.jsonl", ['{"prompt": "1+1="}'])
    held_out = write_lines(tmp_path / "e.jsonl", ['{"prompt": "1+1=", "answer": [2]}'])
    with pytest.raises(DataError, match=rf'^data.eval_path: {held_out}:1: field "answer": expected a string'):
        build_datasets(DataSection(train_path=train, eval_path=held_out))


def test_chat_messages_are_checked_for_roles_and_string_contents(tmp_path):
    rows = [{"messages": []},
            {"messages": ["hi"]},
            {"messages": [{"role": "human", "content": "hi"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            {"messages": [{"content": "hi"}, {"role": "user"}]},
            {"messages": [{"role": "system", "content": "be brief"}]},
            # valid: every accepted role; a null prompt next to messages is an absent prompt
            {"prompt": None, "messages": [{"role": r, "content": "x"} for r in
                                          ("system", "user", "assistant", "tool", "user")]}]
    path = write_lines(tmp_path / "chat.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(DataError) as err:
        build_datasets(DataSection(train_path=path))
    roles = "['system', 'user', 'assistant', 'tool']"
    assert error_lines(err) == [
        f'data.train_path: {path}:1: field "messages": expected a non-empty list of {{"role", "content"}} '
        "objects, got a list of 0",
        f'data.train_path: {path}:2: field "messages[0]": expected a {{"role", "content"}} object, '
        "got a string ('hi')",
        f'data.train_path: {path}:3: field "messages[0].role": expected one of {roles}, '
        "got a string ('human')",
        f'data.train_path: {path}:4: field "messages[0].content": expected a string, got a list of 1',
        f'data.train_path: {path}:5: field "messages[0].role": expected one of {roles}, got null',
        f'data.train_path: {path}:5: field "messages[1].content": expected a string, got null',
        f'data.train_path: {path}:6: field "messages": expected at least one "user" message, got roles '
        "['system']",
    ]
    ok = PromptDataset([rows[-1]])
    assert ok.prompt(0) == "x" and ok.messages(0)[3]["role"] == "tool"


def test_parquet_rows_are_named_by_index_and_nulls_are_absent_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "p.parquet")
    table = pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2", "data_source": None},
                                  {"prompt": None, "answer": "3", "data_source": "math"}])
    pq.write_table(table, path)
    with pytest.raises(DataError) as err:
        build_datasets(DataSection(train_path=path))
    assert error_lines(err) == [f'data.train_path: {path}: row 1: has neither a prompt field "prompt" nor '
                                "chat messages \"messages\" (fields: ['answer', 'data_source'])"]
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken.parquet: cannot read as parquet"):
        build_datasets(DataSection(train_path=str(tmp_path / "broken.parquet")))


def test_answers_are_text_and_an_integer_answer_is_its_decimal_text():
    ds = PromptDataset([{"prompt": "1+1=", "answer": 2}, {"prompt": "1+2=", "answer": "3"}, {"prompt": "x"}])
    assert [ds.answer(i) for i in range(3)] == ["2", "3", None]


# ---------------------------------------------------------------- prompt lengths
@pytest.fixture(scope="module")
def tokenizer():
    tok = make_char_tokenizer(ALPHABET)  # one token per character, plus <bos>
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    return tok


def lengths_file(tmp_path) -> str:
    rows = [{"prompt": "1+1="},                                   # 5 tokens
            {"prompt": "12345678+12345678="},                     # 19 tokens
            {"messages": [{"role": "user", "content": "1234567"}, {"role": "user", "content": "12345"}]},
            {"prompt": "1+2="}]
    return write_lines(tmp_path / "len.jsonl", [json.dumps(r) for r in rows])


def test_overlong_prompts_are_named_by_line_and_length(tmp_path, tokenizer):
    path = lengths_file(tmp_path)
    ro = RolloutSection(max_model_len=24, max_new_tokens=12)  # at most 12 prompt tokens
    train, _ = build_datasets(DataSection(train_path=path))
    overlong = check_prompt_lengths(train, tokenizer, ro)
    chat = tokenizer.apply_chat_template(train.messages(2), add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    assert len(chat) == 14  # the chat template's "=" after each turn counts
    assert [(o.index, o.location, o.prompt_tokens) for o in overlong] == [(1, f"{path}:2", 19),
                                                                         (2, f"{path}:3", 14)]
    cfg = TrainConfig(data=DataSection(train_path=path), rollout=ro)
    with pytest.raises(DataError) as err:
        build_train_set(cfg, tokenizer)
    assert error_lines(err) == [
        f"data.train_path: {path}:2: prompt of 19 tokens leaves no room for rollout.max_new_tokens = 12 in "
        "rollout.max_model_len = 24 (at most 12 prompt tokens)",
        f"data.train_path: {path}:3: prompt of 14 tokens leaves no room for rollout.max_new_tokens = 12 in "
        "rollout.max_model_len = 24 (at most 12 prompt tokens)",
        "shorten these prompts, raise rollout.max_model_len, lower rollout.max_new_tokens, or set "
        "data.overlong: skip to leave them out",
    ]
    # exactly filling the context is allowed: 14 + 12 = 26
    fits = RolloutSection(max_model_len=26, max_new_tokens=12)
    assert [o.index for o in check_prompt_lengths(train, tokenizer, fits)] == [1]


def test_overlong_prompts_are_skipped_before_sampling_and_counted(tmp_path, tokenizer):
    path = lengths_file(tmp_path)
    cfg = TrainConfig(data=DataSection(train_path=path, overlong="skip"),
                      rollout=RolloutSection(max_model_len=24, max_new_tokens=12))
    kept, skipped = build_train_set(cfg, tokenizer)
    assert len(kept) == 2 and [kept.prompt(i) for i in range(2)] == ["1+1=", "1+2="]
    assert [kept.location(i) for i in range(2)] == [f"{path}:1", f"{path}:4"]
    assert [s.index for s in skipped] == [1, 2]
    with pytest.raises(DataError, match="all 1 prompts are overlong"):
        drop_overlong(PromptDataset([{"prompt": "1"}], key="data.train_path"), [Overlong(0, "here", 30)])
    # the audit trail: samples.jsonl counts kept prompts; the skipped ones are listed and counted
    write_skipped(str(tmp_path), [s.to_dict() for s in skipped])
    assert read_skipped(str(tmp_path)) == [{"index": 1, "location": f"{path}:2", "prompt_tokens": 19},
                                           {"index": 2, "location": f"{path}:3", "prompt_tokens": 14}]
    rows = [{"step": 0, "prompt_index": p, "epoch": 0, "sample_index": 0, "version_generated": 0,
             "version_trained": 0, "dropped": False} for p in (1, 0)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = audit_run(str(tmp_path), n=1, dataset_size=len(kept))
    assert report.ok and report.skipped == 2 and report.trained == 2
    assert audit(rows, n=1).skipped == 0


def test_an_empty_prompt_and_a_chat_without_template_are_refused_by_location(tmp_path):
    tok = make_char_tokenizer(ALPHABET)  # no chat template
    path = write_lines(tmp_path / "e.jsonl", ['{"prompt": "1"}',
                                              '{"messages": [{"role": "user", "content": "1"}]}'])
    train, _ = build_datasets(DataSection(train_path=path))
    with pytest.raises(DataError, match=rf"^data.train_path: {path}:2: chat messages need a chat template"):
        check_prompt_lengths(train, tok, RolloutSection())
    no_bos = make_char_tokenizer(ALPHABET)
    no_bos._tokenizer.post_processor = None  # no <bos>: "" encodes to nothing
    empty = PromptDataset([{"prompt": "1"}, {"prompt": ""}], key="data.train_path", name="e")
    with pytest.raises(DataError, match=r"^data.train_path: e: record 1: the prompt encodes to no tokens$"):
        check_prompt_lengths(empty, no_bos, RolloutSection())


# ---------------------------------------------------------------- both launch paths: data before engines
class EngineStarted(Exception):
    """Raised by the patched engine constructors: the run got past its data."""


def engine(*args, **kwargs):
    raise EngineStarted()


@pytest.fixture
def student(tmp_path, tokenizer):
    out = str(tmp_path / "student")
    tokenizer.save_pretrained(out)  # the tokenizer is all the data checks read of the student
    return out


def run_config(tmp_path, student, rows: list[str], **data) -> TrainConfig:
    return TrainConfig(model=ModelSection(student=student),
                       data=DataSection(train_path=write_lines(tmp_path / "d.jsonl", rows), **data),
                       rollout=RolloutSection(max_model_len=24, max_new_tokens=12),
                       run=RunSection(output_dir=str(tmp_path / "run")))


@pytest.fixture
def no_engines(monkeypatch):
    from opkd_mcore.controller import driver
    from opkd_mcore.train import components

    for name in ("build_rollout", "build_scoring_teacher", "init_distributed", "build_trainer_rank"):
        monkeypatch.setattr(components, name, engine)
    monkeypatch.setattr(driver, "WorkerGroups", engine)
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", engine)
    return components, driver


def test_build_run_and_the_ray_driver_read_the_data_before_any_engine(tmp_path, student, no_engines):
    components, driver = no_engines
    cfg = run_config(tmp_path, student, ['{"prompt": "1+1="}', '{"prompt": null}'])
    for launch in (components.build_run, driver.train_with_ray):
        with pytest.raises(DataError, match=r'd.jsonl:2: field "prompt": expected a string, got null'):
            launch(cfg)
    cfg = run_config(tmp_path, student, ['{"prompt": "1+1="}', '{"prompt": "12345678+12345678="}'])
    for launch in (components.build_run, driver.train_with_ray):
        with pytest.raises(DataError, match=r"d.jsonl:2: prompt of 19 tokens leaves no room"):
            launch(cfg)


def test_skipped_prompts_are_logged_and_listed_before_the_engines_start(tmp_path, student, no_engines,
                                                                       caplog):
    components, driver = no_engines
    cfg = run_config(tmp_path, student, ['{"prompt": "12345678+12345678="}', '{"prompt": "1+1="}'],
                     overlong="skip")
    expected = [{"index": 0, "location": f"{tmp_path / 'd.jsonl'}:1", "prompt_tokens": 19}]
    for launch in (components.build_run, lambda c: driver.RayController(c).run()):
        with caplog.at_level(logging.WARNING), pytest.raises(EngineStarted):
            launch(cfg)
        assert read_skipped(cfg.run.output_dir) == expected
        assert "data.overlong: skip: 1 of 2 prompts" in caplog.text
        assert "training on the other 1" in caplog.text
        (tmp_path / "run" / "skipped_prompts.jsonl").unlink()
        caplog.clear()
