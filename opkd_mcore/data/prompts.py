"""Prompt datasets (jsonl / parquet / in-memory records) and a resumable, seeded sampler."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass


def read_records(path: str) -> list[dict]:
    """Rows of a `.jsonl` / `.json` (list) / `.parquet` file as dicts."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:  # pyarrow ships with vllm/ray; say so when it is missing
            raise ValueError(f"data path {path!r}: reading parquet needs pyarrow") from err
        return pq.read_table(path).to_pylist()
    with open(path) as f:
        if path.endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"data path {path!r}: expected a JSON list of objects")
            return rows
        return [json.loads(line) for line in f if line.strip()]


class PromptDataset:
    """Prompt records with a prompt column, and optionally answer and data-source columns."""

    def __init__(self, records: list[dict], *, prompt_key: str = "prompt", answer_key: str = "answer",
                 data_source_key: str = "data_source", messages_key: str = "messages",
                 name: str = "dataset"):
        if not records:
            raise ValueError(f"{name}: no records")
        for i, row in enumerate(records):
            if prompt_key not in row and messages_key not in row:
                raise ValueError(f"{name}: record {i} has neither a prompt column {prompt_key!r} nor "
                                 f"chat messages {messages_key!r} (columns: {sorted(row)})")
            messages = row.get(messages_key)
            if messages is not None and not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
                raise ValueError(f"{name}: record {i}: {messages_key!r} must be a non-empty list of "
                                 "{'role', 'content'} objects")
        self.records = records
        self.prompt_key, self.answer_key, self.data_source_key = prompt_key, answer_key, data_source_key
        self.messages_key = messages_key

    @classmethod
    def from_file(cls, path: str, **keys) -> "PromptDataset":
        if not os.path.isfile(path):
            raise ValueError(f"data path {path!r}: file does not exist")
        return cls(read_records(path), name=path, **keys)

    def __len__(self) -> int:
        return len(self.records)

    def prompt(self, i: int) -> str:
        """The text prompt (for a chat record without one: its last user message)."""
        row = self.records[i]
        if self.prompt_key in row:
            return row[self.prompt_key]
        return next(m["content"] for m in reversed(row[self.messages_key]) if m["role"] == "user")

    def messages(self, i: int) -> list[dict] | None:
        """The chat messages of record i, or None for a text-only record."""
        return self.records[i].get(self.messages_key)

    def answer(self, i: int) -> str | None:
        return self.records[i].get(self.answer_key)

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
