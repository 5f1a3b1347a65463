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


@dataclass(frozen=True)
class Overlong:
    """One prompt that leaves no room for the response."""

    index: int  # its index in the dataset as read, before any prompt was skipped
    location: str  # where it is in its file: `path:LINE`, `path: record I`, `path: row I`
    prompt_tokens: int  # its length as the rollout gets it (chat template applied)

    def to_dict(self) -> dict:
        return asdict(self)


def max_prompt_tokens(rollout: RolloutSection) -> int:
    """The longest prompt that leaves room for `rollout.max_new_tokens` in `rollout.max_model_len`."""
    return rollout.max_model_len - rollout.max_new_tokens


def check_prompt_lengths(dataset: PromptDataset, tokenizer, rollout: RolloutSection,
                         chat_template: str = "auto") -> list[Overlong]:
    """Tokenize every prompt of `dataset` as the rollout will (`encode_record`) and return the
    overlong ones, in dataset order. A prompt that cannot be encoded (chat messages without a chat
    template) or encodes to no tokens (vLLM refuses an empty prompt) is a `DataError`."""
    key, limit = dataset.key, max_prompt_tokens(rollout)
    overlong, empty = [], []
    for i in range(len(dataset)):
        try:
            n = len(encode_record(tokenizer, dataset, i, chat_template))
        except ValueError as err:  # the same cause for every chat record: the first one says it
            raise DataError([str(err)], key) from None
        if n == 0:
            empty.append(f"{dataset.location(i)}: the prompt encodes to no tokens")
        elif n > limit:
            overlong.append(Overlong(index=i, location=dataset.location(i), prompt_tokens=n))
    if empty:
        raise DataError(empty, key)
    return overlong


def overlong_error(overlong: list[Overlong], rollout: RolloutSection, key: str | None) -> DataError:
    """The error of `data.overlong: error`: each overlong prompt by file, line and length."""
    problems = [f"{o.location}: prompt of {o.prompt_tokens} tokens leaves no room for rollout.max_new_tokens "
                f"= {rollout.max_new_tokens} in rollout.max_model_len = {rollout.max_model_len} "
                f"(at most {max_prompt_tokens(rollout)} prompt tokens)" for o in overlong]
    hint = ("shorten these prompts, raise rollout.max_model_len, lower rollout.max_new_tokens, or set "
            "data.overlong: skip to leave them out")
    return DataError(problems, key, hint=hint)


def drop_overlong(dataset: PromptDataset, overlong: list[Overlong]) -> PromptDataset:
    """`dataset` without the `overlong` prompts (the others keep their order and locations); a
    dataset with nothing left is a `DataError`."""
    gone = {o.index for o in overlong}
    kept = [i for i in range(len(dataset)) if i not in gone]
    if not kept:
        raise DataError([f"{dataset.name}: all {len(dataset)} prompts are overlong (data.overlong: skip "
                         "left nothing to train on)"], dataset.key)
    return dataset.subset(kept)


def build_train_set(cfg: TrainConfig, tokenizer) -> tuple[PromptDataset, list[Overlong]]:
    """The prompts a run samples from, checked before any engine starts: every row of both data
    files (`build_datasets`), then every training prompt's length (`check_prompt_lengths`; the
    held-out file is not drawn by the rollout). `data.overlong: error` raises a `DataError` naming
    each overlong prompt; `skip` returns (the dataset without them, the skipped ones)."""
    train, _ = build_datasets(cfg.data)
    overlong = check_prompt_lengths(train, tokenizer, cfg.rollout, cfg.data.chat_template)
    if not overlong:
        return train, []
    if cfg.data.overlong != "skip":
        raise overlong_error(overlong, cfg.rollout, train.key)
    return drop_overlong(train, overlong), overlong
