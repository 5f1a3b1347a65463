"""The in-order schedule: rollout -> teacher -> train -> weight sync, one step after another.

`DistillationRun` holds the parts of a run (built by `entry.py` or the demo) and `step()` runs
the four stages of `train/stages.py` in order. An overlapping controller replaces `step()` and
reuses the stages.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.data import PromptDataset, PromptSampler, encode_record
from opkd_mcore.losses import HiddenTeacher, TopKTeacher
from opkd_mcore.platform import is_rank0
from opkd_mcore.rollout import SamplingConfig
from opkd_mcore.rollout.vllm_rollout import sample_seed
from opkd_mcore.train import stages
from opkd_mcore.train.checkpoint import TrainerState
from opkd_mcore.train.samples_log import batch_records, default_teacher_name, draw_epochs
from opkd_mcore.train.teacher_setup import route_data

logger = logging.getLogger(__name__)


@dataclass
class DistillationRun:
    """Everything one step needs. `rollout` / `teacher` are None on ranks other than 0."""

    cfg: TrainConfig
    engine: object  # MegatronEngine of the student
    chunks: list  # the student's Megatron chunks on this rank
    rollout: object | None  # VllmRollout
    teacher: object | None  # Teacher or TeacherRouter
    syncer: object  # weight_sync.engine_link.SpmdWeightSync
    tokenizer: object
    dataset: PromptDataset
    sampler: PromptSampler
    shard: stages.ShardLayout
    tp_group: object = None
    state: TrainerState = field(default_factory=TrainerState)
    rewards: object = None  # data.rewards.TaskRewards when the loss uses task rewards
    samples_log: object = None  # train.samples_log.SamplesLog (rank 0 writes samples.jsonl); None: off

    def prompts(self) -> stages.PromptBatch:
        """The next prompts (same on every rank: the sampler is seeded and stepped everywhere),
        each with its own sampling seed (from the run's seed, the step and its place in the batch)."""
        return encode_prompts(self.cfg, self.tokenizer, self.dataset, self.sampler.next_batch(),
                              self.state.step)

    def sampling(self) -> SamplingConfig:
        ro = self.cfg.rollout
        return SamplingConfig(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens)

    def step(self) -> dict[str, float]:
        """One full step; returns its metrics (same on every rank)."""
        start = time.perf_counter()
        drawn_from = self.sampler.state_dict()  # where this step's prompts start (their epochs)
        prompts = self.prompts()
        scored = None
        if is_rank0():
            rolled = stages.rollout_stage(self.rollout, prompts, self.sampling())
            scored = stages.teacher_stage(self.teacher, rolled)
            timings = {"timing/rollout": rolled.seconds, "timing/teacher": scored.seconds}
            if self.rewards is not None:
                timings.update(stages.reward_stage(scored, self.rewards, self.tokenizer))
        scored, timings = stages.share_from_rank0((scored, timings if is_rank0() else None))
        result = stages.train_stage(self.engine, scored, self.cfg.loss, self.cfg.parallel, self.shard,
                                    self.tp_group)
        self._log_samples(prompts, drawn_from, scored)
        self.state.step += 1
        sync_s = 0.0
        if self.state.step % self.cfg.weight_sync.every_steps == 0:
            sync_s = stages.weight_sync_stage(self.syncer, self.state.weight_version + 1)
            self.state.weight_version += 1
        self.state.sampler = self.sampler.state_dict()
        step_s = time.perf_counter() - start
        metrics = {**result.metrics, **timings, **rollout_metrics(scored)}
        metrics.update({"timing/train": result.seconds, "timing/weight_sync": sync_s,
                        "timing/step": step_s, "rollout/weight_version": float(self.state.weight_version),
                        "perf/tokens_per_s": metrics["rollout/response_tokens"] / max(step_s, 1e-9)})
        return metrics

    def _log_samples(self, prompts: stages.PromptBatch, drawn_from: dict, scored: stages.ScoredBatch) -> None:
        """One samples.jsonl line per trained sample (the in-order schedule drops nothing)."""
        if self.samples_log is None:
            return

        epochs = draw_epochs(drawn_from, len(self.dataset), len(prompts.indices))
        self.samples_log.write(batch_records(
            self.state.step, prompts.indices, epochs, scored.samples, self.state.weight_version,
            default_teacher_name(self.cfg.teacher.teachers)))


def encode_prompts(cfg: TrainConfig, tokenizer, dataset: PromptDataset, indices: list[int],
                   batch_number: int) -> stages.PromptBatch:
    """Token ids, routed data and sampling seeds of the prompts `indices`, drawn as batch
    `batch_number` (the step, in order); the Ray controller draws its prompts through this too."""
    data = [route_data(cfg, {"data_source": dataset.data_source(i), "answer": dataset.answer(i),
                             "prompt": dataset.prompt(i)}) for i in indices]
    ids = [encode_record(tokenizer, dataset, i, cfg.data.chat_template) for i in indices]
    seeds = [sample_seed(cfg.rollout.seed, batch_number, j) for j in range(len(indices))]
    return stages.PromptBatch(indices=list(indices), prompt_ids=ids, data=data, seeds=seeds)


def rollout_metrics(scored: stages.ScoredBatch) -> dict[str, float]:
    """Response length stats, stop fraction and teacher/student agreement of one step's samples."""
    lengths = [len(s.response_ids) for s in scored.samples]
    stopped = [s.finish_reason == "stop" for s in scored.samples]
    agree = total = 0
    for sample, rows in zip(scored.samples, scored.teacher):
        # scored inside the student's step, or hidden states whose logits exist only in the fused
        # LM-head loss: the loss measures agreement there
        if rows is None or isinstance(rows, HiddenTeacher):
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
