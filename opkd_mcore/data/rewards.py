"""Task rewards per data source, and GRPO-style group-normalised advantages.

A reward function takes the decoded response and the prompt's record data (answer, data_source,
...) and returns a float. `data.rewards` maps a data source to "exact_match" (the built-in: 1.0
when the response, stripped, equals the record's answer) or to "module:function" (imported once).
A data source without an entry gets exact match when its records have an answer; otherwise asking
for its reward is an error naming the data source.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence

from opkd_mcore.data.addition import exact_match

RewardFn = Callable[[str, dict], float]


def _exact_match(response: str, data: dict) -> float:
    answer = data.get("answer")
    if answer is None:
        raise ValueError(f"reward exact_match: the record of data source {data.get('data_source')!r} "
                         "has no answer")
    return exact_match(response, str(answer))


def load_reward(spec: str, source: str = "?") -> RewardFn:
    """The reward function named by `spec` ("exact_match" or "module:function")."""
    if spec == "exact_match":
        return _exact_match
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"data.rewards.{source}: expected 'exact_match' or 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"data.rewards.{source}: cannot import {spec!r} ({err})") from None
    if not callable(fn):
        raise ValueError(f"data.rewards.{source}: {spec!r} is not callable")
    return fn


class TaskRewards:
    """Reward functions by data source (`data.rewards`), loaded once."""

    def __init__(self, specs: dict[str, str]):
        self._fns = {source: load_reward(spec, source) for source, spec in specs.items()}

    def score(self, response: str, data: dict) -> float:
        source = data.get("data_source", "default")
        fn = self._fns.get(source, _exact_match)
        value = float(fn(response, data))
        if not math.isfinite(value):
            raise ValueError(f"reward of data source {source!r}: expected a finite number, got {value}")
        return value


def group_advantages(rewards: Sequence[float], group_ids: Sequence[int], eps: float = 1e-6) -> list[float]:
    """GRPO advantages: (r - mean of the group) / (std of the group + eps); 0 for a group whose
    rewards are all equal (nothing to prefer)."""
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        groups.setdefault(g, []).append(r)
    stats = {}
    for g, values in groups.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        stats[g] = (mean, std)
    return [(r - stats[g][0]) / (stats[g][1] + eps) for r, g in zip(rewards, group_ids)]
