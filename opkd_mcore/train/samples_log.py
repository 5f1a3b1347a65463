"""`<output_dir>/samples.jsonl`: the data audit trail, one line per trained or dropped sample.

Both launch shapes write it: the torchrun SPMD loop (`train/loop.py`, rank 0) and the Ray
controller (`controller/driver.py`). Each line is a `SampleRecord`; `audit()` reads a file back and
says whether every prompt was trained exactly once per epoch with all of its samples, which is what
the schedules promise (a peer's one-step-off recipe trained its first batch twice).

Prompts skipped before sampling (`data.overlong: skip`) are not in the dataset the sampler draws
from: `prompt_index` counts the kept prompts, and `<output_dir>/skipped_prompts.jsonl` lists the
skipped ones (index as read, file location, length), rewritten at every start of the run; `audit`
reports their count.

On `--resume` the file is cut back to the lines of steps before the resumed one (a torn last line
is dropped), exactly like `metrics.jsonl`: the steps after the checkpoint are trained again, and
prompts that were in flight at the checkpoint are generated again, so their lines appear once.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from opkd_mcore.train.metrics import read_jsonl, truncate_jsonl

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
SKIPPED_FILE = "skipped_prompts.jsonl"


@dataclass
class SampleRecord:
    """One sample's fate; `step` is the optimizer step that trained it (or decided to drop it)."""

    step: int
    prompt_index: int  # the prompt's index in the training dataset
    epoch: int  # the pass over the dataset the prompt was drawn in
    sample_index: int  # which of the prompt's n samples (0..n-1)
    version_generated: int  # weight version it was sampled with (the oldest, when a response spans several)
    version_trained: int  # weight version the trainer had published when it trained (or dropped) it
    teacher: str | None  # the teacher it was routed to
    dropped: bool = False
    reason: str | None = None  # why it was dropped
    token_versions: list[list[int]] | None = None  # [[version, tokens], ...] when the response spans versions

    def to_json(self) -> str:
        record = asdict(self)
        if record["token_versions"] is None:
            del record["token_versions"]
        return json.dumps(record)


class SamplesLog:
    """Appends records to `<out_dir>/samples.jsonl`; a disabled log (other ranks) writes nothing."""

    def __init__(self, out_dir: str, *, start_step: int = 0, enabled: bool = True):
        self.path = os.path.join(out_dir, SAMPLES_FILE)
        self.enabled = enabled
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            truncate_jsonl(self.path, start_step)

    def write(self, records: list[SampleRecord]) -> None:
        if not self.enabled or not records:
            return
        with open(self.path, "a") as f:
            f.write("".join(r.to_json() + "\n" for r in records))


def write_skipped(out_dir: str, skipped: list[dict]) -> str:
    """`<out_dir>/skipped_prompts.jsonl`: one line per prompt left out of the dataset (empty when
    none), replaced whole so that it always describes this run's dataset; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, SKIPPED_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(s) + "\n" for s in skipped))
    os.replace(tmp, path)
    return path


def read_skipped(out_dir: str) -> list[dict]:
    """The skipped prompts of a run ([] when the run wrote no such file)."""
    return read_jsonl(os.path.join(out_dir, SKIPPED_FILE))


def draw_epochs(sampler_state: dict, dataset_size: int, count: int) -> list[int]:
    """Epoch of each of `count` prompts drawn in order from a `PromptSampler` at `sampler_state`
    (the sampler rolls to the next epoch when its position reaches the end of the dataset)."""
    epoch, position = int(sampler_state.get("epoch", 0)), int(sampler_state.get("position", 0))
    return [epoch + (position + j) // dataset_size for j in range(count)]


def default_teacher_name(teachers) -> str | None:
    """The teacher a sample without a routed `teacher` goes to: the one without data sources."""
    return next((t.name for t in teachers if not t.data_sources), None)


@dataclass
class Audit:
    """What `audit` found; `ok` when nothing was trained twice and every trained group is whole."""

    trained: int = 0  # trained sample lines
    dropped: int = 0  # dropped sample lines
    duplicates: list[tuple] = field(default_factory=list)  # (epoch, prompt, sample) trained twice
    partial_groups: list[tuple] = field(default_factory=list)  # (epoch, prompt) missing samples
    missing: dict[int, list[int]] = field(default_factory=dict)  # complete epochs: prompts never trained
    max_staleness: int = 0  # largest version_trained - version_generated among trained samples
    skipped: int = 0  # prompts left out of the dataset before sampling (skipped_prompts.jsonl)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.partial_groups or self.missing)


def read_samples(out_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(out_dir, SAMPLES_FILE))


def audit_run(out_dir: str, n: int, dataset_size: int | None = None) -> Audit:
    """`audit` of a run directory: its samples.jsonl, with the count of its skipped prompts."""
    return audit(read_samples(out_dir), n, dataset_size, skipped=read_skipped(out_dir))


def audit(records: list[dict], n: int, dataset_size: int | None = None,
          skipped: list[dict] | None = None) -> Audit:
    """Check the exactly-once promise on the records of one run.

    Every trained (epoch, prompt, sample) appears once; every trained prompt has all `n` samples;
    and, given `dataset_size` (the kept prompts, after any skipped ones), every epoch that training
    has moved past holds every prompt. `skipped` (`read_skipped`) is counted, not checked.
    """
    result = Audit(skipped=len(skipped or []))
    keys: Counter = Counter()
    groups: dict[tuple, set] = defaultdict(set)
    for r in records:
        if r["dropped"]:
            result.dropped += 1
            continue
        result.trained += 1
        keys[(r["epoch"], r["prompt_index"], r["sample_index"])] += 1
        groups[(r["epoch"], r["prompt_index"])].add(r["sample_index"])
        result.max_staleness = max(result.max_staleness, r["version_trained"] - r["version_generated"])
    result.duplicates = sorted(k for k, c in keys.items() if c > 1)
    result.partial_groups = sorted(g for g, s in groups.items() if s != set(range(n)))
    if dataset_size is not None and groups:
        last_epoch = max(e for e, _ in groups)
        for epoch in range(last_epoch):  # epochs before the last one must be complete
            trained = {p for e, p in groups if e == epoch}
            missing = sorted(set(range(dataset_size)) - trained)
            if missing:
                result.missing[epoch] = missing
    return result
