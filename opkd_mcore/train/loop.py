"""The in-order schedule: rollout -> teacher -> train -> weight sync, one step after another.

`DistillationRun` holds the parts of a run (built by `train/components.py: build_run`) and `step()`
runs the four stages of `train/stages.py` in order and reports through `train/step_report.py`. The
Ray controller overlaps the same stages and reports through the same functions.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.data import PromptDataset, PromptSampler, encode_record
from opkd_mcore.data.rewards import TaskRewards
from opkd_mcore.data.teacher_prompts import TeacherPrompts, encode_teacher_prompt
from opkd_mcore.engine.megatron_engine import MegatronEngine
from opkd_mcore.losses.plan import LossPlan
from opkd_mcore.platform import is_rank0
from opkd_mcore.rollout import VllmRollout
from opkd_mcore.rollout.vllm_rollout import sample_seed
from opkd_mcore.teacher.base import SampleScorer
from opkd_mcore.train import stages
from opkd_mcore.train.checkpoint import TrainerState
from opkd_mcore.train.samples_log import SamplesLog, draw_epochs
from opkd_mcore.train.step_report import (
    prompt_groups,
    rollout_metrics,
    sample_records,
    sampling_config,
    step_metrics,
)
from opkd_mcore.train.teacher_setup import route_data
from opkd_mcore.weight_sync.engine_link import SpmdWeightSync

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


logger = logging.getLogger(__name__)


@dataclass
class DistillationRun:
    """Everything one step needs. `rollout` / `teacher` are None on ranks other than 0."""

    cfg: TrainConfig
    engine: MegatronEngine  # the student
    chunks: list[torch.nn.Module]  # the student's Megatron chunks on this rank
    rollout: VllmRollout | None
    teacher: SampleScorer | None  # None also when the teacher runs inside the student's step
    syncer: SpmdWeightSync
    tokenizer: PreTrainedTokenizerBase
    dataset: PromptDataset
    sampler: PromptSampler
    shard: stages.ShardLayout
    loss_plan: LossPlan  # the run's loss path, decided once at start-up (losses/plan.py)
    tp_group: ProcessGroup | None = None
    state: TrainerState = field(default_factory=TrainerState)
    rewards: TaskRewards | None = None  # when the loss uses task rewards
    samples_log: SamplesLog | None = None  # rank 0 writes samples.jsonl; None: off

    def prompts(self) -> stages.PromptBatch:
        """The next prompts (same on every rank: the sampler is seeded and stepped everywhere),
        each with its own sampling seed (from the run's seed, the step and its place in the batch)."""
        return encode_prompts(self.cfg, self.tokenizer, self.dataset, self.sampler.next_batch(),
                              self.state.step)

    def step(self) -> dict[str, float]:
        """One full step; returns its metrics (same on every rank)."""
        start = time.perf_counter()
        drawn_from = self.sampler.state_dict()  # where this step's prompts start (their epochs)
        prompts = self.prompts()
        scored = None
        if is_rank0():
            rolled = stages.rollout_stage(self.rollout, prompts, sampling_config(self.cfg))
            scored = stages.teacher_stage(self.teacher, rolled)
            timings = {"timing/rollout": rolled.seconds, "timing/teacher": scored.seconds}
            if self.rewards is not None:
                timings.update(stages.reward_stage(scored, self.rewards, self.tokenizer))
        scored, timings = stages.share_from_rank0((scored, timings if is_rank0() else None))
        result = stages.train_stage(self.engine, scored, self.loss_plan, self.cfg.parallel, self.shard,
                                    self.tp_group)
        self._log_samples(prompts, drawn_from, scored)
        self.state.step += 1
        sync_s = 0.0
        if self.state.step % self.cfg.weight_sync.every_steps == 0:
            sync_s = stages.weight_sync_stage(self.syncer, self.state.weight_version + 1)
            self.state.weight_version += 1
        self.state.sampler = self.sampler.state_dict()
        step_s = time.perf_counter() - start
        return step_metrics({**result.metrics, **timings, **rollout_metrics(scored)},
                            train_s=result.seconds, sync_s=sync_s, step_s=step_s,
                            weight_version=self.state.weight_version)

    def _log_samples(self, prompts: stages.PromptBatch, drawn_from: dict[str, int],
                     scored: stages.ScoredBatch) -> None:
        """One samples.jsonl line per trained sample (the in-order schedule drops nothing)."""
        if self.samples_log is None:
            return
        epochs = draw_epochs(drawn_from, len(self.dataset), len(prompts.indices))
        groups = prompt_groups(prompts.indices, epochs, scored.samples)
        self.samples_log.write(sample_records(self.state.step, groups, self.state.weight_version,
                                              self.cfg.teacher.teachers))


def encode_prompts(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, dataset: PromptDataset,
                   indices: list[int], batch_number: int) -> stages.PromptBatch:
    """Token ids, routed data and sampling seeds of the prompts `indices`, drawn as batch
    `batch_number` (the step, in order); the Ray controller draws its prompts through this too."""
    data = [route_data(cfg, {"data_source": dataset.data_source(i), "answer": dataset.answer(i),
                             "prompt": dataset.prompt(i), "messages": dataset.messages(i)}) for i in indices]
    ids = [encode_record(tokenizer, dataset, i, cfg.data.chat_template) for i in indices]
    seeds = [sample_seed(cfg.rollout.seed, batch_number, j) for j in range(len(indices))]
    teacher_ids = None
    teacher_prompts = TeacherPrompts.from_config(cfg.data)
    if teacher_prompts is not None:  # every record has one: the others were refused or skipped
        teacher_ids = [encode_teacher_prompt(tokenizer, dataset, i, teacher_prompts, cfg.data.chat_template)
                       for i in indices]
    return stages.PromptBatch(indices=list(indices), prompt_ids=ids, data=data, seeds=seeds,
                              teacher_prompt_ids=teacher_ids)
