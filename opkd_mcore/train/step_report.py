"""What one optimizer step reports, the same under both launchers.

    sampling_config(cfg)     the rollout's `SamplingConfig`, from the `rollout` section (and whether
                             anything reads the sampler's logprobs: `reads_sampler_logprobs`)
    rollout_metrics(scored)  response lengths, stop fraction, teacher/student top-1 agreement
    step_metrics(...)        the step's metrics: its stages' own, timings, tokens/s, weight version
    sample_records(...)      its samples.jsonl lines, one per trained or dropped sample

The torchrun loop (`train/loop.py`) and the Ray driver (`controller/driver.py`) both build their
step's report here, so `metrics.jsonl` and `samples.jsonl` mean the same under either; the driver
adds what only an overlapped schedule has (waits, overlap, staleness, faults).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from opkd_mcore.config.schema import TeacherEndpoint, TrainConfig
from opkd_mcore.losses import CrossTokenizerTeacher, HiddenTeacher, TopKTeacher
from opkd_mcore.losses.span_teacher import exact_top1_agreement
from opkd_mcore.rollout import Sample, SamplingConfig
from opkd_mcore.train.samples_log import SampleRecord, default_teacher_name
from opkd_mcore.train.stages import ScoredBatch


def reads_sampler_logprobs(cfg: TrainConfig) -> bool:
    """Whether anything in the run reads the rollout sampler's token logprobs: the policy-gradient
    form (its importance ratio) and the truncated importance weights of stale samples. Otherwise the
    engine is not asked for them (a log-softmax over the vocabulary per decode step, per-token lists
    built in Python)."""
    return cfg.loss.form == "policy_gradient" or cfg.run.stale_policy == "truncated_is"


def sampling_config(cfg: TrainConfig) -> SamplingConfig:
    """How the rollout samples every step (seeds come per prompt, with the prompts)."""
    ro = cfg.rollout
    return SamplingConfig(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, logprobs=reads_sampler_logprobs(cfg))


def rollout_metrics(scored: ScoredBatch) -> dict[str, float]:
    """Response length stats, stop fraction and teacher/student agreement of one step's samples."""
    lengths = [len(s.response_ids) for s in scored.samples]
    stopped = [s.finish_reason == "stop" for s in scored.samples]
    agree = total = 0
    for sample, rows in zip(scored.samples, scored.teacher):
        # scored inside the student's step, or hidden states whose logits exist only in the fused
        # LM-head loss: the loss measures agreement there
        if rows is None or isinstance(rows, HiddenTeacher):
            continue
        if isinstance(rows, CrossTokenizerTeacher):  # another tokenizer: on the spans of one same token
            hits, compared = exact_top1_agreement(rows, torch.tensor(sample.sequence[1:] + [-1]))
            agree, total = agree + hits, total + compared
            continue
        if not isinstance(rows, TopKTeacher):
            top1 = rows.logits.argmax(-1)
        else:
            top1 = rows.ids[:, 0]
        start = len(sample.prompt_ids) - 1
        for t, token in enumerate(sample.response_ids):
            agree += int(top1[start + t]) == token
            total += 1
    return {
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/response_len_min": float(min(lengths)),
        "rollout/stop_fraction": sum(stopped) / len(stopped),
        "rollout/response_tokens": float(sum(lengths)),
        "rollout/num_samples": float(len(lengths)),
        **({"teacher/top1_agreement": agree / total} if total else {}),
    }


def step_metrics(stages: Mapping[str, float], *, train_s: float, sync_s: float, step_s: float,
                 weight_version: int) -> dict[str, float]:
    """One step's metrics. `stages`: what its stages measured (the optimizer step's metrics, the
    `rollout_metrics` of its samples, rewards, `timing/rollout` and `timing/teacher`); `train_s`,
    `sync_s`, `step_s`: seconds of the train stage, the weight sync (0 when none was due) and the
    whole step; `weight_version`: the version the rollout holds after the step."""
    if "rollout/response_tokens" not in stages:
        raise KeyError(f"stages: expected the step's rollout_metrics (rollout/response_tokens), got "
                       f"{sorted(stages)}")
    return {**stages, "timing/train": train_s, "timing/weight_sync": sync_s, "timing/step": step_s,
            "rollout/weight_version": float(weight_version),
            "perf/tokens_per_s": stages["rollout/response_tokens"] / max(step_s, 1e-9)}


@dataclass
class PromptSamples:
    """One prompt's samples as a step trained (or dropped) them."""

    prompt_index: int  # the prompt's index in the training dataset
    epoch: int  # the pass over the dataset it was drawn in
    samples: list[Sample]  # its n samples, in sample order
    # per sample: [[version, tokens], ...] when its response spans weight versions, else None
    token_versions: list[list[list[int]] | None] | None = None
    dropped: str | None = None  # why the step dropped the group; None: trained


def prompt_groups(indices: list[int], epochs: list[int], samples: list[Sample]) -> list[PromptSamples]:
    """The prompts of an in-order batch: `sample.group_id` is the prompt's position in `indices`,
    `epochs[j]` the epoch prompt j was drawn in."""
    groups = [PromptSamples(prompt_index=i, epoch=e, samples=[]) for i, e in zip(indices, epochs)]
    for s in samples:
        groups[s.group_id].samples.append(s)
    return groups


def sample_records(step: int, groups: list[PromptSamples], version_trained: int,
                   teachers: list[TeacherEndpoint]) -> list[SampleRecord]:
    """The samples.jsonl lines of one step, group by group. A sample's teacher is the one its data
    was routed to, else the run's default teacher (the one without data sources)."""
    default = default_teacher_name(teachers)
    records = []
    for group in groups:
        for k, s in enumerate(group.samples):
            records.append(SampleRecord(
                step=step, prompt_index=group.prompt_index, epoch=group.epoch, sample_index=k,
                version_generated=s.weight_version, version_trained=version_trained,
                teacher=s.data.get("teacher", default), dropped=group.dropped is not None,
                reason=group.dropped,
                token_versions=None if group.token_versions is None else group.token_versions[k]))
    return records
