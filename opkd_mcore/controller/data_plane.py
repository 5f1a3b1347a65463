"""Prompts between the sampler and the trainer: the exactly-once bookkeeping of the Ray controller.

Every prompt the sampler has drawn is *outstanding* (waiting, generating, generated, being scored,
or handed back after a drop or a dead engine) until the trainer takes it, and then it is gone.
So at any moment drawn = trained + outstanding, and a checkpoint that stores the sampler's position
and the outstanding prompts (`PromptQueue.state_dict`) lets `--resume` generate exactly the prompts
that were not trained: in-flight work at the checkpoint is re-queued, never lost and never doubled.
The stored state keeps `PromptSampler`'s own keys (`epoch`, `position`), so a torchrun run can read
a checkpoint of the Ray controller's `sync` schedule (nothing is outstanding there).

A prompt's sampling seed is fixed when it is drawn (from the run's seed, its draw number and its
place in the draw, as in the torchrun loop), so a re-queued prompt keeps it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from opkd_mcore.rollout import Sample
from opkd_mcore.train.samples_log import draw_epochs


@dataclass
class PromptJob:
    """One prompt to generate n samples for."""

    prompt_index: int  # index in the training dataset
    epoch: int  # the pass over the dataset it was drawn in
    batch: int  # its draw number (the step, under the in-order schedules)
    position: int  # its place in that draw
    seed: int  # sampling seed of its n samples
    prompt_ids: list[int]
    data: dict  # routed per-prompt data (data_source, answer, teacher)
    teacher_prompt_ids: list[int] | None = None  # the teacher's own prompt (None: the student's)

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.prompt_index)


@dataclass(eq=False)  # compared by identity: a re-generated prompt is another group
class GroupResult:
    """A prompt's n samples, as they came back from a rollout engine."""

    job: PromptJob
    samples: list[Sample]
    # per sample: [[version, tokens], ...] when its response spans weight versions, else None
    token_versions: list[list[list[int]] | None]
    seconds: float  # this group's share of the engine call's wall time
    # per sample: (teacher call id, row in that call's rows)
    teacher_rows: list[tuple[int, int] | None] = field(default_factory=list)
    pending_teacher_calls: int = 0  # teacher calls holding its rows that have not returned
    deferred: bool = False  # the schedule has not let it be scored yet

    @property
    def version(self) -> int:
        """The oldest weight version any of its tokens was generated with."""
        return min(s.weight_version for s in self.samples)


class PromptQueue:
    """Draws prompts from the run's `PromptSampler` and tracks the outstanding ones."""

    def __init__(self, draw_fn, sampler, dataset_size: int, batch_size: int):
        """`draw_fn(indices, batch_number) -> stages.PromptBatch` encodes prompts (as
        `train.loop.encode_prompts` does)."""
        self._draw_fn, self._epochs = draw_fn, draw_epochs
        self.sampler, self.dataset_size, self.batch_size = sampler, dataset_size, batch_size
        self.batches_drawn = 0
        self.outstanding: dict[tuple[int, int], PromptJob] = {}  # draw order
        self.waiting: deque[PromptJob] = deque()  # outstanding and not being worked on

    # ---- drawing ---------------------------------------------------------------------------
    def _encode(self, indices: list[int], epochs: list[int], batch: int, positions: list[int],
                seeds: list[int] | None = None) -> list[PromptJob]:
        prompts = self._draw_fn(indices, batch)
        seeds = seeds or [prompts.seeds[p] for p in positions]
        teacher_ids = prompts.teacher_prompt_ids or [None] * len(indices)
        return [PromptJob(prompt_index=i, epoch=e, batch=batch, position=p, seed=s, prompt_ids=ids, data=d,
                          teacher_prompt_ids=t)
                for i, e, p, s, ids, d, t in zip(indices, epochs, positions, seeds, prompts.prompt_ids,
                                                 prompts.data, teacher_ids)]

    def draw(self) -> list[PromptJob]:
        """The next `batch_size` prompts from the sampler (all outstanding from now on)."""
        epochs = self._epochs(self.sampler.state_dict(), self.dataset_size, self.batch_size)
        indices = self.sampler.next_batch()
        jobs = self._encode(indices, epochs, self.batches_drawn, list(range(len(indices))))
        self.batches_drawn += 1
        for job in jobs:
            if job.key in self.outstanding:  # a batch larger than the dataset would repeat a prompt
                raise ValueError(f"rollout.prompts_per_step: prompt {job.prompt_index} of epoch "
                                 f"{job.epoch} drawn twice in one draw (more prompts per step than "
                                 f"the dataset's {self.dataset_size})")
            self.outstanding[job.key] = job
        return jobs

    def next_batch_number(self) -> int:
        """The draw number `next_batch` returns next."""
        return self.waiting[0].batch if self.waiting else self.batches_drawn

    def next_batch(self) -> list[PromptJob]:
        """Batch schedules: the oldest waiting draw (restored at resume), else a new one."""
        if self.waiting:
            batch = self.waiting[0].batch
            jobs = [j for j in self.waiting if j.batch == batch]
            self.waiting = deque(j for j in self.waiting if j.batch != batch)
            return jobs
        return self.draw()

    def take(self, count: int) -> list[PromptJob]:
        """Async: up to `count` prompts, handed-back ones first, then new draws."""
        while len(self.waiting) < count:
            self.waiting.extend(self.draw())
        return [self.waiting.popleft() for _ in range(count)]

    # ---- life cycle ------------------------------------------------------------------------
    def requeue(self, jobs: list[PromptJob]) -> None:
        """Hand prompts back (dropped as stale, or their engine died): served before anything new."""
        for job in reversed(jobs):
            if job.key not in self.outstanding:
                raise RuntimeError(f"requeue: prompt {job.prompt_index} (epoch {job.epoch}) is not "
                                   "outstanding (already trained?)")
            self.waiting.appendleft(job)

    def trained(self, jobs: list[PromptJob]) -> None:
        for job in jobs:
            if self.outstanding.pop(job.key, None) is None:
                raise RuntimeError(f"prompt {job.prompt_index} (epoch {job.epoch}) handed to the trainer "
                                   "twice, or never drawn")

    # ---- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = dict(self.sampler.state_dict())
        state["batches_drawn"] = self.batches_drawn
        state["outstanding"] = [[j.epoch, j.prompt_index, j.batch, j.position, j.seed]
                                for j in self.outstanding.values()]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the sampler and make every outstanding prompt wait, in draw order."""
        self.sampler.load_state_dict(state)
        self.batches_drawn = int(state.get("batches_drawn", 0))
        self.outstanding, self.waiting = {}, deque()
        rows = state.get("outstanding", [])
        for batch in sorted({r[2] for r in rows}):
            mine = [r for r in rows if r[2] == batch]
            jobs = self._encode([r[1] for r in mine], [r[0] for r in mine], batch, [r[3] for r in mine],
                                seeds=[r[4] for r in mine])
            for job in jobs:
                self.outstanding[job.key] = job
        # the stored order (draw order, handed-back prompts where they were drawn) is the order served
        self.outstanding = {tuple(r[:2]): self.outstanding[tuple(r[:2])] for r in rows}
        self.waiting.extend(self.outstanding.values())
