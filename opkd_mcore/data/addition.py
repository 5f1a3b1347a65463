"""Synthetic exact-answer task for the demo: fixed-width addition, scored by exact match.

A prompt is `"07+45="`; the answer is the sum with `digits + 1` digits written least-significant
digit first (`"250"` for 52), which a small transformer can learn left to right because each digit
then depends only on digits already seen. Everything is deterministic from a seed; the held-out
split never shares a problem with the training split.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

ALPHABET = "0123456789+="


@dataclass(frozen=True)
class AdditionTask:
    """Fixed-width addition of two `digits`-digit numbers."""

    digits: int = 2  # digits per operand (zero padded)
    reverse_answer: bool = True  # write the sum least-significant digit first

    def prompt(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    def answer(self, a: int, b: int) -> str:
        text = f"{a + b:0{self.digits + 1}d}"
        return text[::-1] if self.reverse_answer else text

    @property
    def answer_len(self) -> int:
        return self.digits + 1

    @property
    def num_problems(self) -> int:
        return (10 ** self.digits) ** 2

    def splits(self, num_train: int, num_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
        """Disjoint train / held-out lists of `{"prompt", "answer", "data_source"}` records."""
        if num_train + num_eval > self.num_problems:
            raise ValueError(f"num_train + num_eval: {num_train + num_eval} exceeds the "
                             f"{self.num_problems} distinct {self.digits}-digit problems")
        if num_train < 0 or num_eval < 0:
            raise ValueError(f"num_train/num_eval: expected >= 0, got {num_train}/{num_eval}")
        rng = random.Random(seed)
        base = 10 ** self.digits
        picks = rng.sample(range(self.num_problems), num_train + num_eval)
        records = [self.record(p // base, p % base) for p in picks]
        return records[num_eval:], records[:num_eval]

    def record(self, a: int, b: int) -> dict:
        return {"prompt": self.prompt(a, b), "answer": self.answer(a, b), "data_source": "addition"}


def exact_match(response: str, answer: str) -> float:
    """1.0 when the decoded response (special tokens and surrounding spaces removed) is the answer."""
    return float(response.strip() == answer.strip())
