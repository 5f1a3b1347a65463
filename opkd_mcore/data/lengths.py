"""Prompt lengths against the rollout's context, measured before any engine starts.

vLLM refuses a prompt that fills its context and cuts a response short where prompt + response
reaches `rollout.max_model_len`; a prompt is therefore overlong when its tokens (exactly as the
rollout gets them: `encode_record`, chat template included) plus `rollout.max_new_tokens` exceed
`rollout.max_model_len`. `data.overlong: error` refuses such a file, naming every overlong prompt;
`skip` removes them from the dataset before sampling (see `TrainConfig.data.overlong`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from opkd_mcore.config.schema import RolloutSection, TrainConfig
from opkd_mcore.data.build import build_datasets, encode_record
from opkd_mcore.data.prompts import PromptDataset
from opkd_mcore.data.records import DataError
from opkd_mcore.data.teacher_prompts import (
    MissingTeacherPrompt,
    TeacherPrompts,
    encode_teacher_prompt,
    find_missing,
    missing_error,
)


@dataclass(frozen=True)
class Overlong:
    """One prompt that leaves no room for the response."""

    index: int  # its index in the dataset as read, before any prompt was skipped
    location: str  # where it is in its file: `path:LINE`, `path: record I`, `path: row I`
    prompt_tokens: int  # its length as the rollout gets it (chat template applied)
    teacher_prompt_tokens: int | None = None  # the teacher's own prompt's length, when it has one

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def max_prompt_tokens(rollout: RolloutSection) -> int:
    """The longest prompt that leaves room for `rollout.max_new_tokens` in `rollout.max_model_len`."""
    return rollout.max_model_len - rollout.max_new_tokens


def check_prompt_lengths(dataset: PromptDataset, tokenizer, rollout: RolloutSection,
                         chat_template: str = "auto", teacher_prompts: TeacherPrompts | None = None,
                         without_teacher_prompt: frozenset[int] = frozenset()) -> list[Overlong]:
    """Tokenize every prompt of `dataset` as the rollout will (`encode_record`) and return the
    overlong ones, in dataset order; with `teacher_prompts` each record's teacher prompt too (but
    those of `without_teacher_prompt`), which precedes the same response when the teacher scores it.
    A prompt that cannot be encoded (chat messages without a chat template) or encodes to no tokens
    (vLLM refuses an empty prompt) is a `DataError`."""
    key, limit = dataset.key, max_prompt_tokens(rollout)
    overlong, empty = [], []
    for i in range(len(dataset)):
        try:
            n = len(encode_record(tokenizer, dataset, i, chat_template))
            n_teacher = None
            if teacher_prompts is not None and i not in without_teacher_prompt:
                n_teacher = len(encode_teacher_prompt(tokenizer, dataset, i, teacher_prompts, chat_template))
        except ValueError as err:  # the same cause for every chat record: the first one says it
            raise DataError([str(err)], key) from None
        if n == 0 or n_teacher == 0:
            which = "prompt" if n == 0 else "teacher prompt"
            empty.append(f"{dataset.location(i)}: the {which} encodes to no tokens")
        elif max(n, n_teacher or 0) > limit:
            overlong.append(Overlong(index=i, location=dataset.location(i), prompt_tokens=n,
                                     teacher_prompt_tokens=n_teacher))
    if empty:
        raise DataError(empty, key)
    return overlong


def overlong_error(overlong: list[Overlong], rollout: RolloutSection, key: str | None) -> DataError:
    """The error of `data.overlong: error`: each overlong prompt by file, line and length."""
    problems = [f"{o.location}: {_what(o)} leaves no room for rollout.max_new_tokens "
                f"= {rollout.max_new_tokens} in rollout.max_model_len = {rollout.max_model_len} "
                f"(at most {max_prompt_tokens(rollout)} prompt tokens)" for o in overlong]
    hint = ("shorten these prompts, raise rollout.max_model_len, lower rollout.max_new_tokens, or set "
            "data.overlong: skip to leave them out")
    return DataError(problems, key, hint=hint)


def _what(o: Overlong) -> str:
    if o.teacher_prompt_tokens is not None and o.teacher_prompt_tokens > o.prompt_tokens:
        return f"teacher prompt of {o.teacher_prompt_tokens} tokens"
    return f"prompt of {o.prompt_tokens} tokens"


def drop_overlong(dataset: PromptDataset, overlong: list[Overlong | MissingTeacherPrompt]) -> PromptDataset:
    """`dataset` without the `overlong` prompts (or those without a teacher prompt; the others keep
    their order and locations); a dataset with nothing left is a `DataError`."""
    gone = {o.index for o in overlong}
    kept = [i for i in range(len(dataset)) if i not in gone]
    if not kept:
        raise DataError([f"{dataset.name}: all {len(dataset)} prompts are overlong or have no teacher prompt "
                         "(data.overlong / data.missing_teacher_prompt: skip left nothing to train on)"],
                        dataset.key)
    return dataset.subset(kept)


def build_train_set(cfg: TrainConfig,
                    tokenizer) -> tuple[PromptDataset, list[Overlong | MissingTeacherPrompt]]:
    """The prompts a run samples from, checked before any engine starts: every row of both data
    files (`build_datasets`), every record's teacher prompt when the run gives the teacher its own
    (`data/teacher_prompts.py`), then every training prompt's length (`check_prompt_lengths`; the
    held-out file is not drawn by the rollout). `data.overlong: error` (`data.missing_teacher_prompt:
    error`) raises a `DataError` naming each overlong prompt (each record without a teacher prompt);
    `skip` returns (the dataset without them, the skipped ones in dataset order)."""
    train, _ = build_datasets(cfg.data)
    teacher_prompts = TeacherPrompts.from_config(cfg.data)
    missing = find_missing(train, teacher_prompts)
    if missing and cfg.data.missing_teacher_prompt != "skip":
        raise missing_error(missing, train.key)
    overlong = check_prompt_lengths(train, tokenizer, cfg.rollout, cfg.data.chat_template, teacher_prompts,
                                    frozenset(m.index for m in missing))
    if overlong and cfg.data.overlong != "skip":
        raise overlong_error(overlong, cfg.rollout, train.key)
    skipped = sorted([*missing, *overlong], key=lambda o: o.index)
    if not skipped:
        return train, []
    return drop_overlong(train, skipped), skipped
