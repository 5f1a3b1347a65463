"""The schedules: which generations and teacher calls run while the trainer works.

The driver's `RolloutFeed` keeps every rollout and teacher call in flight, reacts to whichever
finishes first (`ray.wait`) and hands the trainer its batches; a policy decides what may start:

    sync          batch j is generated once the weights of step j-1 are in the engines (in order)
    one_step_off  batch j+1 is generated (weights of step j) while batch j is scored and trained;
                  batch j+1 is scored after step j trained
    two_step_off  batch j+2 is generated and batch j+1 scored while batch j trains
    async         engines generate continuously; prompt number a starts only while
                  a < (engine version + run.max_staleness + 1) * prompts_per_step, so a sample is at
                  most max_staleness versions old when trained; batches are taken in completion
                  order, and a group past the bound anyway (it finished late) is dropped and its
                  prompt generated again, or kept with a truncated importance weight

Teacher rows are never fetched here: a teacher call returns (rows, seconds) as two objects, the
driver reads the seconds and hands the rows' reference to the trainer ranks. A teacher call scores
the samples generated together, up to `controller.teacher_call_tokens` tokens; a trainer rank pulls
the calls that hold its samples.
"""
from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opkd_mcore.controller.data_plane import GroupResult, PromptJob
from opkd_mcore.controller.groups import is_actor_death
from opkd_mcore.engine.micro_batches import consecutive_chunks

if TYPE_CHECKING:
    from ray import ObjectRef

logger = logging.getLogger(__name__)

DEPTH = {"sync": 0, "one_step_off": 1, "two_step_off": 2}


@dataclass
class RolloutCall:
    engine: int
    jobs: list[PromptJob]


@dataclass
class TeacherCall:
    """One teacher call: samples (group, sample index) scored together."""

    id: int
    teacher: str
    members: list[tuple[GroupResult, int]]
    replica: int = 0
    rows: ObjectRef | None = None  # the call's list[TeacherOutput] in the object store
    seconds: float | None = None  # set when the call has returned
    users: int = 0  # groups not yet trained or dropped that read this call's rows


@dataclass
class StepWork:
    """What the driver needs of one batch: its groups (in order) and what was dropped on the way."""

    groups: list[GroupResult]
    dropped: list[tuple[GroupResult, str]] = field(default_factory=list)
    stale: list[bool] = field(default_factory=list)  # per group: past the bound, kept (truncated_is)
    wait_rollout: float = 0.0
    wait_teacher: float = 0.0


class RolloutFeed:
    """Feeds the trainer scored groups: the rollout and teacher calls in flight, the generated
    groups, and the engines' weight version."""

    def __init__(self, cfg, groups, queue, *, version: int, step: int, sampling, on_event=None):
        import ray

        self.ray = ray
        self.cfg, self.groups, self.queue, self.sampling = cfg, groups, queue, sampling
        self.on_event = on_event or (lambda name, info: None)
        self.version = version  # weights the engines hold
        self.steps_trained = step  # optimizer steps trained (and synced when due)
        self.prompts_trained = step * cfg.rollout.prompts_per_step  # (the async bound)
        self.rollout_calls: dict[ObjectRef, RolloutCall] = {}  # generate calls in flight
        # by their seconds' reference, until it returns
        self.teacher_in_flight: dict[ObjectRef, TeacherCall] = {}
        self.teacher_calls: dict[int, TeacherCall] = {}  # id -> call, until no group reads its rows
        self.generated: dict[tuple, GroupResult] = {}  # generated, not yet trained, in completion order
        self.deferred: list[GroupResult] = []  # generated, teacher call not yet allowed
        self.in_flight = 0  # prompts generating or generated and not handed to the trainer
        self.busy = [0] * len(groups.rollouts)
        self.idle_since = [time.perf_counter()] * len(groups.rollouts)
        self.idle_s = 0.0
        self.next_call_id = 0
        self.requeued = 0
        self.steps_since_sync = 0  # optimizer steps submitted since the engines' weights were synced
        self.step = step
        self.policy = AsyncPolicy() if cfg.run.schedule == "async" else BatchPolicy(cfg.run.schedule)
        names = [t.name for t in cfg.teacher.teachers if not t.data_sources]
        self.default_teacher = names[0] if names else None

    # ---- rollout ---------------------------------------------------------------------------
    def segment_tokens(self) -> int | None:
        run = self.cfg.run
        return run.partial_rollout_tokens if run.in_flight_update == "abort_resume" else None

    def submit(self, engine: int, jobs: list[PromptJob]) -> None:
        ref = self.groups.rollouts[engine].generate.remote(jobs, self.sampling, self.segment_tokens())
        self.rollout_calls[ref] = RolloutCall(engine, jobs)
        if not self.busy[engine]:
            self.idle_s += (time.perf_counter() - self.idle_since[engine]) / len(self.busy)
        self.busy[engine] += 1
        self.on_event("rollout_submitted", {"engine": engine, "step": self.step,
                                            "prompts": [j.prompt_index for j in jobs]})

    def least_busy(self) -> int:
        return min(range(len(self.busy)), key=lambda e: self.busy[e])

    def _engine_done(self, engine: int) -> None:
        self.busy[engine] -= 1
        if not self.busy[engine]:
            self.idle_since[engine] = time.perf_counter()

    def _on_generated(self, ref) -> None:
        call = self.rollout_calls.pop(ref)
        self._engine_done(call.engine)
        try:
            reply = self.ray.get(ref)
        except Exception as err:  # only an actor's death is handled here; the rest is re-raised
            if not is_actor_death(err):
                raise
            self._engine_died(call, err)
            return
        share = reply.seconds / len(call.jobs)
        ready = []  # scored together: one teacher call holds as many of them as its token budget allows
        for job, samples, versions in zip(call.jobs, reply.samples, reply.token_versions):
            group = GroupResult(job=job, samples=samples, token_versions=versions, seconds=share)
            self.generated[job.key] = group
            if self.policy.may_score(self, job):
                ready.append(group)
            else:
                group.deferred = True
                self.deferred.append(group)
        if ready:
            self._score(ready)

    def _engine_died(self, call: RolloutCall, err) -> None:
        """Re-queue the dead engine's prompts, bring it back with the current weights, go on."""
        logger.warning("controller: rollout engine %d died with %d prompts in flight (%s); re-queued",
                       call.engine, len(call.jobs), type(err).__name__)
        self.requeued += len(call.jobs)
        self.on_event("rollout_died", {"engine": call.engine, "prompts": [j.prompt_index for j in call.jobs]})
        ahead = self.steps_since_sync > 0
        self.version = self.groups.recover_rollout(call.engine, ahead, self.version)
        if ahead:
            self.steps_since_sync = 0
        self.policy.requeue(self, call.jobs)

    # ---- teachers --------------------------------------------------------------------------
    def _teacher_of(self, job: PromptJob) -> str:
        name = job.data.get("teacher", self.default_teacher)
        if name is None:
            raise ValueError(f"teacher.teachers: no teacher for data source {job.data.get('data_source')!r} "
                             "(no teacher lists it and there is no default teacher)")
        return name

    def _score(self, groups: list[GroupResult]) -> None:
        """Send the groups' samples to their teachers, up to `controller.teacher_call_tokens` tokens per call
        and at least one call per replica."""
        if not self.groups.teachers:  # the teacher scores inside the student's step
            for g in groups:
                g.teacher_rows = [None] * len(g.samples)
            return
        by_teacher = defaultdict(list)
        for g in groups:
            g.teacher_rows = [None] * len(g.samples)
            for k in range(len(g.samples)):
                by_teacher[self._teacher_of(g.job)].append((g, k))
        for name, members in by_teacher.items():
            lengths = [len(g.samples[k].teacher_sequence) for g, k in members]
            # no fewer calls than the teacher has replicas, so that every replica scores a share
            replicas = len(self.groups.teachers[name])
            budget = min(self.cfg.controller.teacher_call_tokens, -(-sum(lengths) // replicas))
            for chunk in consecutive_chunks(lengths, budget):
                call = TeacherCall(id=self.next_call_id, teacher=name, members=[members[i] for i in chunk])
                self.next_call_id += 1
                self.teacher_calls[call.id] = call
                for row, (g, k) in enumerate(call.members):
                    g.teacher_rows[k] = (call.id, row)
                for g in _distinct(call.members):
                    g.pending_teacher_calls += 1
                    call.users += 1
                self._call_teacher(call)

    def _call_teacher(self, call: TeacherCall) -> None:
        replicas = self.groups.teachers[call.teacher]
        load = defaultdict(int)
        for c in self.teacher_in_flight.values():
            if c.teacher == call.teacher:
                load[c.replica] += 1
        call.replica = min(range(len(replicas)), key=lambda i: load[i])
        sequences = [g.samples[k].teacher_sequence for g, k in call.members]  # its prompt + the response
        call.rows, seconds = replicas[call.replica].score.options(num_returns=2).remote(sequences)
        self.teacher_in_flight[seconds] = call
        self.on_event("teacher_submitted", {"teacher": call.teacher, "replica": call.replica,
                                            "step": self.step, "call": call.id})

    def _on_scored(self, ref) -> None:
        call = self.teacher_in_flight.pop(ref)
        try:
            call.seconds = self.ray.get(ref)
        except Exception as err:  # only an actor's death is handled here; the rest is re-raised
            if not is_actor_death(err):
                raise
            logger.warning("controller: teacher %s[%d] died in teacher call %d; re-sent", call.teacher,
                           call.replica, call.id)
            self.groups.recover_teacher(call.teacher, call.replica)
            self._call_teacher(call)
            return
        for g in _distinct(call.members):
            g.pending_teacher_calls -= 1

    def release_deferred(self) -> None:
        ready = [g for g in self.deferred if self.policy.may_score(self, g.job)]
        self.deferred = [g for g in self.deferred if not self.policy.may_score(self, g.job)]
        for g in ready:
            g.deferred = False
        if ready:
            self._score(ready)

    @staticmethod
    def scored(group: GroupResult) -> bool:
        return not group.deferred and group.pending_teacher_calls == 0

    # ---- the event loop --------------------------------------------------------------------
    def process_finished(self, also=(), timeout: float | None = None) -> list:
        """Handle every finished call (waiting up to `timeout` for one), start what the schedule
        allows; returns the refs of `also` that are ready."""
        refs = [*also, *self.rollout_calls, *self.teacher_in_flight]
        if not refs:
            self.policy.admit(self)
            return []
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        if not ready and timeout != 0:
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=False)
        for ref in ready:
            if ref in self.rollout_calls:
                self._on_generated(ref)
            elif ref in self.teacher_in_flight:
                self._on_scored(ref)
        self.policy.admit(self)
        return [r for r in ready if r in also]

    def wait_until(self, predicate, what: str, timeout_s: float) -> float:
        """Process finished calls until `predicate()`; returns the seconds waited."""
        start = time.perf_counter()
        while not predicate():
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"controller: {what} not done within {timeout_s:.0f} s "
                                   f"({len(self.rollout_calls)} generate and {len(self.teacher_in_flight)} "
                                   "teacher calls in flight)")
            self.process_finished(timeout=1.0)
            if not (self.rollout_calls or self.teacher_in_flight or predicate()):
                raise RuntimeError(f"controller: waiting for {what} with nothing in flight")
        return time.perf_counter() - start

    def wait_for(self, ref, what: str, timeout_s: float):
        """Process finished calls until `ref` (a trainer or sync call) is ready; returns its value."""
        start = time.perf_counter()
        while not self.process_finished(also=[ref], timeout=1.0):
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"controller: {what} did not return within {timeout_s:.0f} s")
        return self.ray.get(ref)

    # ---- batches ---------------------------------------------------------------------------
    def take_batch(self, step: int) -> StepWork:
        self.step = step
        self.policy.admit(self)
        return self.policy.take_batch(self, step)

    def release_group(self, group: GroupResult) -> None:
        """A group left the feed (trained or dropped): release its teacher calls' rows."""
        self.generated.pop(group.job.key, None)
        self.in_flight -= 1
        for call_id in {r[0] for r in group.teacher_rows if r is not None}:
            call = self.teacher_calls[call_id]
            call.users -= 1
            if call.users == 0:  # the trainer has pulled it: the object store may free it
                del self.teacher_calls[call_id]

    def mark_trained(self, work: StepWork) -> None:
        """The groups of `work` were trained: they leave the feed and count against the async bound."""
        for g in work.groups:
            self.release_group(g)
        self.prompts_trained += len(work.groups)

    def take_idle_seconds(self) -> float:
        """Engine-idle seconds since the last call (averaged over engines): the rollout waiting."""
        now = time.perf_counter()
        for e, busy in enumerate(self.busy):
            if not busy:
                self.idle_s += (now - self.idle_since[e]) / len(self.busy)
                self.idle_since[e] = now
        idle, self.idle_s = self.idle_s, 0.0
        return idle


def _distinct(members: list[tuple[GroupResult, int]]) -> list[GroupResult]:
    seen: dict[int, GroupResult] = {}
    for g, _ in members:
        seen.setdefault(id(g), g)
    return list(seen.values())


class BatchPolicy:
    """sync / one_step_off / two_step_off: batch j is generated from the weights of step j - depth."""

    def __init__(self, schedule: str):
        self.depth = DEPTH[schedule]
        self.eager_teacher = schedule == "two_step_off"

    def may_score(self, feed: RolloutFeed, job: PromptJob) -> bool:
        return self.eager_teacher or feed.steps_trained >= job.batch

    def admit(self, feed: RolloutFeed) -> None:
        steps = feed.cfg.run.steps
        while True:
            batch = feed.queue.next_batch_number()
            if batch >= steps or batch > feed.steps_trained + self.depth:
                return
            jobs = feed.queue.next_batch()
            feed.in_flight += len(jobs)
            self._spread(feed, jobs)

    @staticmethod
    def _spread(feed: RolloutFeed, jobs: list[PromptJob]) -> None:
        """Contiguous slices over the engines (seeds are per prompt: the split changes no sample)."""
        engines = len(feed.busy)
        per = math.ceil(len(jobs) / engines)
        for s in range(0, len(jobs), per):
            feed.submit(feed.least_busy(), jobs[s:s + per])

    def requeue(self, feed: RolloutFeed, jobs: list[PromptJob]) -> None:
        self._spread(feed, jobs)  # the same prompts, the same batch: generated again at once

    def take_batch(self, feed: RolloutFeed, step: int) -> StepWork:
        keys = [k for k, j in feed.queue.outstanding.items() if j.batch == step]
        timeout = feed.cfg.controller.call_timeout_s
        work = StepWork(groups=[])
        work.wait_rollout = feed.wait_until(lambda: all(k in feed.generated for k in keys),
                                            f"rollout of batch {step}", timeout)
        groups = sorted((feed.generated[k] for k in keys), key=lambda g: g.job.position)
        feed.release_deferred()
        work.wait_teacher = feed.wait_until(lambda: all(feed.scored(g) for g in groups),
                                            f"teacher scoring of batch {step}", timeout)
        work.groups, work.stale = groups, [False] * len(groups)
        return work


class AsyncPolicy:
    """Continuous generation into a queue bounded by the staleness bound; batches in completion order."""

    def may_score(self, feed: RolloutFeed, job: PromptJob) -> bool:
        return True

    def admit(self, feed: RolloutFeed) -> None:
        run, size = feed.cfg.run, feed.cfg.rollout.prompts_per_step
        per_call = math.ceil(size / len(feed.busy))
        while True:
            engine = feed.least_busy()
            if feed.busy[engine]:
                return
            bound = (feed.version + run.max_staleness + 1) * size
            needed = run.steps * size  # never generate past the last step's prompts
            room = min(bound, needed) - feed.prompts_trained - feed.in_flight
            if room <= 0:
                return
            jobs = feed.queue.take(min(per_call, room))
            feed.in_flight += len(jobs)
            feed.submit(engine, jobs)

    def requeue(self, feed: RolloutFeed, jobs: list[PromptJob]) -> None:
        feed.in_flight -= len(jobs)
        feed.queue.requeue(jobs)

    def take_batch(self, feed: RolloutFeed, step: int) -> StepWork:
        run, size = feed.cfg.run, feed.cfg.rollout.prompts_per_step
        timeout = feed.cfg.controller.call_timeout_s
        work = StepWork(groups=[])
        start = time.perf_counter()
        while len(work.groups) < size:
            feed.wait_until(lambda: len(feed.generated) > len(work.groups), f"rollout for step {step}",
                            timeout)
            taken = {g.job.key for g in work.groups}
            group = next(g for k, g in feed.generated.items() if k not in taken)
            lag = feed.version - group.version
            if lag <= run.max_staleness:
                work.groups.append(group)
                work.stale.append(False)
            elif run.stale_policy == "truncated_is":
                work.groups.append(group)
                work.stale.append(True)
            else:
                reason = (f"stale: generated with v{group.version}, trainer at v{feed.version} "
                          f"(run.max_staleness {run.max_staleness})")
                work.dropped.append((group, reason))
                # generated again, before anything new, and at once: while it counted as in flight
                # the staleness bound could leave no room to generate the groups this step still needs
                feed.release_group(group)
                feed.requeued += 1
                feed.queue.requeue([group.job])
        work.wait_rollout = time.perf_counter() - start
        work.wait_teacher = feed.wait_until(lambda: all(feed.scored(g) for g in work.groups),
                                            f"teacher scoring for step {step}", timeout)
        return work
