"""The four stages of one distillation step, each a function with typed arguments and results.

    prompts --rollout_stage--> RolloutBatch --teacher_stage--> ScoredBatch
            --train_stage--> TrainResult --weight_sync_stage--> new weight version

The in-order loop (`train/loop.py`) calls them one after another; a controller that overlaps them
(one-step-off, async) calls the same functions on other workers. Rollout and teacher scoring run
where the engines live (rank 0 in an SPMD job); `share_from_rank0` hands their results to every
trainer rank.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from opkd_kernels.linear_kd_common import PAD_LOGIT
from opkd_mcore.config.schema import ParallelSection
from opkd_mcore.data.rewards import TaskRewards, group_advantages
from opkd_mcore.engine.megatron_engine import MegatronEngine
from opkd_mcore.engine.micro_batches import micro_batch_groups
from opkd_mcore.engine.packing import PackedBatch, pack_model_input, pack_sequences
from opkd_mcore.engine.response_pairing import packed_response_index, pair_scored_rows
from opkd_mcore.losses import DenseTeacher, TopKTeacher, teacher_confidence_scores, teacher_confidence_weights
from opkd_mcore.losses.plan import LossPlan
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher, concat_cross_teachers
from opkd_mcore.losses.teacher_outputs import PAD_ID, HiddenTeacher
from opkd_mcore.rollout import Sample, SamplingConfig, VllmRollout
from opkd_mcore.teacher.base import SampleScorer, TeacherOutput
from opkd_mcore.teacher.cross_tokenizer import CrossTokenizerScorer
from opkd_mcore.train.objective import StepCounts, make_loss_fn
from opkd_mcore.weight_sync.engine_link import SpmdWeightSync

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase



@dataclass
class PromptBatch:
    """Prompts of one step: dataset indices, token ids, per-prompt data (answer, data_source), one
    sampling seed per prompt (None: the engine's own stream), and the teacher's own prompt of each
    (`data/teacher_prompts.py`; None for all or one: the teacher scores the student's prompt)."""

    indices: list[int]
    prompt_ids: list[list[int]]
    data: list[dict]
    seeds: list[int] | None = None
    teacher_prompt_ids: list[list[int] | None] | None = None


@dataclass
class RolloutBatch:
    """Student samples of one step, prompt-major (n per prompt)."""

    samples: list[Sample]
    seconds: float = 0.0


@dataclass
class ScoredBatch:
    """Samples with one teacher output each (`len(sequence) - 1` rows, row t scores token t+1;
    None when the teacher scores inside the student's step), and optional task-reward advantages."""

    samples: list[Sample]
    teacher: list[TeacherOutput | None]
    seconds: float = 0.0
    task_advantages: list[float] | None = None  # one per sample (GRPO, group-normalised)


@dataclass
class TrainResult:
    """What one optimizer step reports (same on every rank)."""

    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def rollout_stage(rollout: VllmRollout, prompts: PromptBatch, sampling: SamplingConfig) -> RolloutBatch:
    start = time.perf_counter()
    samples = rollout.generate(prompts.prompt_ids, sampling, data=prompts.data, seeds=prompts.seeds)
    if prompts.teacher_prompt_ids is not None:
        for s in samples:  # group_id: the prompt's place in the batch
            s.teacher_prompt_ids = prompts.teacher_prompt_ids[s.group_id]
    return RolloutBatch(samples=samples, seconds=time.perf_counter() - start)


def teacher_stage(teacher: SampleScorer | None, batch: RolloutBatch) -> ScoredBatch:
    """Score every sample's teacher prompt + response with its data (a router picks the teacher by
    it), each sample's rows paired with its own rows (`paired_rows`); `teacher` None when the
    teacher runs inside the student's step (rows stay None)."""
    start = time.perf_counter()
    if teacher is None:
        return ScoredBatch(samples=batch.samples, teacher=[None] * len(batch.samples))
    if isinstance(teacher, CrossTokenizerScorer):  # another tokenizer: it re-tokenizes the samples
        return ScoredBatch(samples=batch.samples, teacher=teacher.score_rollout(batch.samples),
                           seconds=time.perf_counter() - start)
    rows = teacher.score_samples([s.teacher_sequence for s in batch.samples], [s.data for s in batch.samples])
    rows = [paired_rows(r, s) for r, s in zip(rows, batch.samples)]
    return ScoredBatch(samples=batch.samples, teacher=rows, seconds=time.perf_counter() - start)


def paired_rows(rows: TeacherOutput | None, sample: Sample) -> TeacherOutput | None:
    """A teacher's rows of `sample.teacher_sequence` in the layout of `sample.sequence`: the same when
    the teacher scored the student's prompt, else each response row moved to the student's row of the
    same token and the prompt rows padding (`engine/response_pairing.py`)."""
    if sample.teacher_prompt_ids is None:
        return rows
    return pair_scored_rows(rows, len(sample.prompt_ids), len(sample.teacher_prompt_ids),
                            len(sample.response_ids))


def reward_stage(scored: ScoredBatch, rewards: TaskRewards,
                 tokenizer: PreTrainedTokenizerBase) -> dict[str, float]:
    """Task rewards of the samples and their group-normalised advantages (into `scored`)."""
    values = [rewards.score(tokenizer.decode(s.response_ids, skip_special_tokens=True), s.data)
              for s in scored.samples]
    scored.task_advantages = group_advantages(values, [s.group_id for s in scored.samples])
    return {"reward/mean": sum(values) / len(values)}


def share_from_rank0(obj):
    """`obj` of rank 0 on every rank (pickled over the default group); identity on one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _pad_teacher_rows(out, shard: "ShardLayout"):
    """One extra (padding) row for the last position of a sequence; dense rows cut to this TP shard.

    A dense teacher's columns past the student's vocabulary (its own padding) are dropped or get
    probability 0: the loss compares the two distributions over the ids the student can emit."""
    if out is None or isinstance(out, CrossTokenizerTeacher):  # a cross-tokenizer one is laid out already
        return out
    if isinstance(out, HiddenTeacher):  # hidden states: this rank's shard of the teacher's output weight
        hidden = torch.cat([out.hidden, out.hidden.new_zeros(1, out.hidden.shape[1])])
        return HiddenTeacher(hidden=hidden, weight=shard.teacher_weight, vocab_size=shard.teacher_vocab)
    logits = out.logits.float()
    if logits.shape[1] != shard.vocab_local:  # a full-vocabulary teacher: pad the vocabulary, take our shard
        keep = min(logits.shape[1], shard.vocab_size or shard.padded_vocab)
        full = torch.full((logits.shape[0], shard.padded_vocab), PAD_LOGIT, dtype=logits.dtype)
        full[:, :keep] = logits[:, :keep]
        logits = full[:, shard.tp_rank * shard.vocab_local:(shard.tp_rank + 1) * shard.vocab_local]
    return DenseTeacher(logits=torch.cat([logits, torch.zeros(1, logits.shape[1])]))


def _micro_batch_teacher(rows: list, shard: "ShardLayout"):
    """The samples' teacher rows as one micro-batch's, each sample's followed by its padding row."""
    if isinstance(rows[0], TopKTeacher):
        return _concat_topk_rows(rows)
    rows = [_pad_teacher_rows(r, shard) for r in rows]
    if rows[0] is None:
        return None
    if isinstance(rows[0], CrossTokenizerTeacher):
        return concat_cross_teachers(rows)
    if isinstance(rows[0], HiddenTeacher):
        return HiddenTeacher(torch.cat([r.hidden for r in rows]), rows[0].weight, rows[0].vocab_size)
    return DenseTeacher(logits=torch.cat([r.logits for r in rows]))


def _concat_topk_rows(rows: list[TopKTeacher]) -> TopKTeacher:
    """Top-k rows of the samples in one allocation: each sample's rows, then one padding row (ids -1,
    logprobs -inf) for its last position; narrower rows padded to the widest k. Each value is copied
    once (padding every sample's rows first, then concatenating, copied the step's rows twice)."""
    width = max(r.ids.shape[1] for r in rows)
    total = sum(r.ids.shape[0] + 1 for r in rows)
    ids = torch.full((total, width), PAD_ID, dtype=rows[0].ids.dtype)
    lps = torch.full((total, width), -math.inf, dtype=rows[0].logprobs.dtype)
    start = 0
    for r in rows:
        n, k = r.ids.shape
        ids[start:start + n, :k] = r.ids
        lps[start:start + n, :k] = r.logprobs
        start += n + 1
    return TopKTeacher(ids=ids, logprobs=lps)


@dataclass
class ShardLayout:
    """Where this rank sits: its DP slice of the step and its vocabulary shard."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    vocab_local: int = 0  # columns of this rank's logits shard
    padded_vocab: int = 0  # all shards together
    vocab_size: int | None = None  # the student's real vocabulary (columns past it are padding)
    # [vocab_local, H_t] shard of a hidden-state teacher's output weight
    teacher_weight: torch.Tensor | None = None
    teacher_vocab: int | None = None  # that teacher's real vocabulary (ids past it get probability 0)


def confidence_weights(scored: ScoredBatch, alpha: float) -> torch.Tensor | None:
    """TCAD sequence weights (softmax of alpha * mean teacher logprob within each prompt's group),
    scaled so they sum to the number of samples; None when alpha = 0."""
    if alpha == 0.0:
        return None
    means = []
    for sample, out in zip(scored.samples, scored.teacher):
        start = len(sample.prompt_ids) - 1
        targets = torch.tensor(sample.response_ids)
        if isinstance(out, TopKTeacher):
            hit = out.ids[start:] == targets[:, None]
            lp = torch.where(hit, out.logprobs[start:], torch.zeros_like(out.logprobs[start:])).sum(1)
            lp = torch.where(hit.any(1), lp, out.logprobs[start:].masked_fill(out.ids[start:] < 0, 0).amin(1))
        else:
            lp = torch.log_softmax(out.logits[start:].float(), -1).gather(1, targets[:, None]).squeeze(1)
        means.append(lp)
    flat = torch.cat(means)
    seq_ids = torch.repeat_interleave(torch.arange(len(means)), torch.tensor([m.numel() for m in means]))
    scores = teacher_confidence_scores(flat, torch.ones_like(flat), seq_ids, len(means))
    groups = torch.tensor([s.group_id for s in scored.samples])
    return teacher_confidence_weights(scores, groups, alpha) * len(scored.samples) / groups.unique().numel()


def pack_micro_batches(scored: ScoredBatch, par: ParallelSection, shard: ShardLayout,
                       seq_weights: torch.Tensor | None = None) -> tuple[list[PackedBatch], StepCounts]:
    """This DP rank's share of the step, packed into micro-batches (`engine.micro_batches`: by
    `micro_batch_size` sequences, or by `max_tokens_per_micro_batch` tokens)."""
    total = len(scored.samples)
    counts = StepCounts(num_tokens=sum(len(s.response_ids) for s in scored.samples), num_seqs=total)
    groups = micro_batch_groups([len(s.sequence) for s in scored.samples], shard.dp_size, shard.dp_rank,
                                micro_batch_size=par.micro_batch_size,
                                max_tokens=par.max_tokens_per_micro_batch)
    batches = []
    for idx in groups:
        samples = [scored.samples[i] for i in idx]
        rows = [scored.teacher[i] for i in idx]
        advantages = scored.task_advantages
        batch = pack_sequences(
            [s.sequence for s in samples], [len(s.prompt_ids) for s in samples],
            sampler_logprobs=_sampler_logprobs(samples), teacher=_micro_batch_teacher(rows, shard),
            sequence_weights=None if seq_weights is None else seq_weights[idx],
            task_advantages=None if advantages is None else [advantages[i] for i in idx])
        own = in_step_teacher_packing(samples, rows)
        if own is not None:
            batch = dataclasses.replace(batch, teacher_tokens=own[0], teacher_index=own[1])
        batches.append(batch)
    return batches, counts


def _sampler_logprobs(samples: list[Sample]) -> list[list[float]] | None:
    """The samples' sampler logprobs, or None where the engine was not asked for them
    (`step_report.reads_sampler_logprobs`: then nothing in the step reads them)."""
    rows = [s.response_logprobs for s in samples]
    return None if any(r is None for r in rows) else rows


def in_step_teacher_packing(samples: list[Sample],
                            teachers: list) -> tuple[PackedBatch, torch.Tensor | None] | None:
    """What an in-step teacher on tokens of its own runs on (engine/teacher_in_step.py): its packing
    of the samples' teacher-side sequences, in order, and with teacher prompts the row of it that each
    row of the student's packing pairs with (`engine/response_pairing.py`); across tokenizers no such
    index (the span index in the teacher's rows pairs them). None when the teacher reads the
    student's packing or already scored (`teachers`: the samples' rows, None for an in-step one)."""
    if isinstance(teachers[0], CrossTokenizerTeacher):
        if teachers[0].rows is not None:
            return None
        return pack_model_input([t.tokens.tolist() for t in teachers]), None
    if teachers[0] is not None or all(s.teacher_prompt_ids is None for s in samples):
        return None
    index = packed_response_index([len(s.prompt_ids) for s in samples],
                                  [s.teacher_prompt_len for s in samples],
                                  [len(s.response_ids) for s in samples])
    return pack_model_input([s.teacher_sequence for s in samples]), index


def train_stage(engine: MegatronEngine, scored: ScoredBatch, plan: LossPlan, par: ParallelSection,
                shard: ShardLayout, tp_group: ProcessGroup | None = None,
                sequence_weights: torch.Tensor | None = None) -> TrainResult:
    """One optimizer step of the student on the scored samples, along the run's loss `plan`
    (`losses/plan.py`). `sequence_weights` (one per sample, e.g. the Ray controller's truncated
    importance weights of stale samples) multiply the teacher-confidence weights."""
    start = time.perf_counter()
    weights = confidence_weights(scored, plan.loss.confidence_alpha)
    if sequence_weights is not None:
        weights = sequence_weights if weights is None else weights * sequence_weights
    # checked here, on the host: the loss takes them as finite (a check there would sync per micro-batch)
    if weights is not None and not bool(torch.isfinite(weights).all()):
        raise ValueError(f"sequence_weights: expected finite values (one per sample), got {weights.tolist()}")
    micro_batches, counts = pack_micro_batches(scored, par, shard, weights)
    packed = time.perf_counter()
    metrics = engine.train_step(micro_batches, make_loss_fn(plan, counts, tp_group),
                                fused_lm_head=plan.fused_lm_head)
    # host-side packing vs the device step: where a slow train stage goes (e.g. a one-CPU Ray actor)
    metrics["timing/train_pack"] = packed - start
    return TrainResult(metrics=metrics, seconds=time.perf_counter() - start)


def weight_sync_stage(syncer: SpmdWeightSync, version: int) -> float:
    """Push the student's weights (as `version`) into the rollout engine; returns seconds taken."""
    start = time.perf_counter()
    syncer.sync(version)
    return time.perf_counter() - start
