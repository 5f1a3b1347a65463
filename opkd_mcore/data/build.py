"""Datasets of a run from its `data` config section, and prompt tokenisation."""
from __future__ import annotations

from opkd_mcore.config.schema import DataSection
from opkd_mcore.data.addition import AdditionTask
from opkd_mcore.data.prompts import PromptDataset


def build_datasets(cfg: DataSection) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, held-out or None): from files, or the synthetic task when no train file is set."""
    keys = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                data_source_key=cfg.data_source_key)
    if cfg.train_path is not None:
        train = PromptDataset.from_file(cfg.train_path, **keys)
        held_out = PromptDataset.from_file(cfg.eval_path, **keys) if cfg.eval_path else None
        return train, held_out
    if cfg.task != "addition":
        raise ValueError(f"data.task: expected 'addition' (or set data.train_path), got {cfg.task!r}")
    train, held_out = AdditionTask(cfg.task_digits).splits(cfg.num_train, cfg.num_eval, cfg.seed)
    return PromptDataset(train, name="addition/train"), PromptDataset(held_out, name="addition/eval")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt; the tokenizer's BOS first when it has one and did not add it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids
