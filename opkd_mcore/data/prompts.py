"""Prompt datasets (jsonl / parquet / in-memory records) and a resumable, seeded sampler."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

from opkd_mcore.data.records import DataError, RowKeys, read_rows, row_problems


def read_records(path: str) -> list[dict]:
    """Rows of a `.jsonl` / `.json` (list) / `.parquet` file, unchecked; a file that cannot be read
    (bad JSON, not UTF-8) is a `DataError` naming every unreadable line."""
    read = read_rows(path)
    if read.problems:
        raise DataError(read.problems)
    return read.rows


class PromptDataset:
    """Prompt records with a prompt column (or chat messages), and optionally answer and
    data-source columns. Every record is checked on construction (`records.row_problems`); a
    `DataError` names each bad one by its `locations` entry (default `"<name>: record <i>"`),
    prefixed with `key` (the config key the data came from) when given."""

    def __init__(self, records: list[dict], *, prompt_key: str = "prompt", answer_key: str = "answer",
                 data_source_key: str = "data_source", messages_key: str = "messages",
                 name: str = "dataset", locations: list[str] | None = None, key: str | None = None):
        if not records:
            raise DataError([f"{name}: no records"], key)
        if locations is not None and len(locations) != len(records):
            raise ValueError(f"locations: expected one per record ({len(records)}), got {len(locations)}")
        self.keys = RowKeys(prompt=prompt_key, answer=answer_key, data_source=data_source_key,
                            messages=messages_key)
        self.locations = locations or [f"{name}: record {i}" for i in range(len(records))]
        problems = [f"{where}: {p}" for row, where in zip(records, self.locations)
                    for p in row_problems(row, self.keys)]
        if problems:
            raise DataError(problems, key)
        self.records, self.name, self.key = records, name, key
        self.prompt_key, self.answer_key, self.data_source_key = prompt_key, answer_key, data_source_key
        self.messages_key = messages_key

    @classmethod
    def from_file(cls, path: str, *, key: str | None = None, **keys) -> "PromptDataset":
        """The records of `path`, read and checked; `key` (e.g. "data.train_path") prefixes errors."""
        if not os.path.isfile(path):
            raise DataError([f"file {path!r} does not exist"], key)
        read = read_rows(path)
        if read.problems:  # unreadable lines first: the rows that did parse are checked after a fix
            raise DataError(read.problems, key)
        return cls(read.rows, name=path, locations=read.locations, key=key, **keys)

    def subset(self, indices: list[int]) -> "PromptDataset":
        """The records `indices`, in that order, keeping where each came from."""
        return PromptDataset([self.records[i] for i in indices], prompt_key=self.prompt_key,
                             answer_key=self.answer_key, data_source_key=self.data_source_key,
                             messages_key=self.messages_key, name=self.name,
                             locations=[self.locations[i] for i in indices], key=self.key)

    def __len__(self) -> int:
        return len(self.records)

    def location(self, i: int) -> str:
        """Where record i came from: `path:LINE`, `path: record I`, `path: row I`."""
        return self.locations[i]

    def prompt(self, i: int) -> str:
        """The text prompt (for a chat record without one: its last user message)."""
        row = self.records[i]
        if row.get(self.prompt_key) is not None:
            return row[self.prompt_key]
        return next(m["content"] for m in reversed(row[self.messages_key]) if m["role"] == "user")

    def messages(self, i: int) -> list[dict] | None:
        """The chat messages of record i, or None for a text-only record."""
        return self.records[i].get(self.messages_key)

    def answer(self, i: int) -> str | None:
        """The answer as text (an integer answer stands for its decimal text)."""
        answer = self.records[i].get(self.answer_key)
        return str(answer) if isinstance(answer, int) else answer

    def data_source(self, i: int) -> str:
        return self.records[i].get(self.data_source_key) or "default"


@dataclass
class SamplerState:
    """Where the sampler is: enough to continue exactly after a restart."""

    epoch: int = 0
    position: int = 0  # index into the epoch's order


class PromptSampler:
    """Draws batches of record indices; reshuffles each epoch with `seed + epoch`."""

    def __init__(self, size: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if batch_size <= 0 or size <= 0:
            raise ValueError(f"batch_size/size: expected > 0, got {batch_size}/{size}")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.state = SamplerState()

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            order = self._order(self.state.epoch)
            take = order[self.state.position:self.state.position + self.batch_size - len(out)]
            out += take
            self.state.position += len(take)
            if self.state.position >= self.size:
                self.state = SamplerState(self.state.epoch + 1, 0)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "position": self.state.position}

    def load_state_dict(self, state: dict) -> None:
        self.state = SamplerState(int(state["epoch"]), int(state["position"]))
