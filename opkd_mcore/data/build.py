"""Datasets of a run from its `data` config section, and prompt tokenisation."""
from __future__ import annotations

from opkd_mcore.config.schema import DataSection
from opkd_mcore.data.addition import AdditionTask
from opkd_mcore.data.prompts import PromptDataset


def build_datasets(cfg: DataSection) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, held-out or None): from files, or the synthetic task when no train file is set.
    Every row of both files is read and checked here; a `DataError` (a `ConfigError`) names each
    bad one as `data.train_path: <file>:<line>: field "prompt": expected a string, got null`."""
    keys = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                data_source_key=cfg.data_source_key, messages_key=cfg.messages_key)
    if cfg.train_path is not None:
        train = PromptDataset.from_file(cfg.train_path, key="data.train_path", **keys)
        if cfg.eval_path is None:
            return train, None
        return train, PromptDataset.from_file(cfg.eval_path, key="data.eval_path", **keys)
    if cfg.task != "addition":
        raise ValueError(f"data.task: expected 'addition' (or set data.train_path), got {cfg.task!r}")
    train, held_out = AdditionTask(cfg.task_digits).splits(cfg.num_train, cfg.num_eval, cfg.seed)
    # num_eval: 0 is allowed: no held-out set rather than an empty one
    return (PromptDataset(train, name="addition/train", key="data.task"),
            PromptDataset(held_out, name="addition/eval", key="data.task") if held_out else None)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a text prompt exactly as `tokenizer(text)` gives them (its special tokens, e.g. a
    BOS, included): what a user of the exported checkpoint, or vLLM's text prompts, will feed."""
    return [int(t) for t in tokenizer(text)["input_ids"]]


def encode_chat(tokenizer, messages: list[dict], *, source: str = "prompt") -> list[int]:
    """Token ids of a chat (list of {"role", "content"}) through the tokenizer's chat template, with
    the assistant turn opened (`add_generation_prompt`), as vLLM's chat API does."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{source}: chat messages need a chat template, and the tokenizer "
                         f"({getattr(tokenizer, 'name_or_path', '?')}) has none; set data.chat_template: "
                         "none and give text prompts")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(t) for t in ids]


def encode_record(tokenizer, dataset: PromptDataset, index: int, chat_template: str = "auto") -> list[int]:
    """Token ids of record `index`: `messages` through the chat template, a text prompt raw (or as
    one user turn when `chat_template` is "always")."""
    messages = dataset.messages(index)
    source = dataset.location(index)
    if messages is not None:
        if chat_template == "none":
            raise ValueError(f"{source}: has chat messages ({dataset.messages_key!r}) but "
                             "data.chat_template is 'none'; give a text prompt or use 'auto'")
        return encode_chat(tokenizer, messages, source=source)
    if chat_template == "always":
        return encode_chat(tokenizer, [{"role": "user", "content": dataset.prompt(index)}], source=source)
    return encode_prompt(tokenizer, dataset.prompt(index))
