"""The Ray driver of `opkd train ... controller.kind=ray`: one step at a time, the stages overlapped.

    batch t  <- feed.take_batch(t)            groups generated (and scored) under the schedule
    train    <- every trainer rank, at once   teacher rows pulled by the ranks, not through here
    samples.jsonl, metrics.jsonl              one line per trained / dropped sample; step metrics
    sync     -> every rollout engine at once  after the step (weight_sync.every_steps)
    save     -> checkpoint                    with the outstanding prompts (re-queued on --resume)

Runs under a local cluster it starts itself, or attaches to one (`RAY_ADDRESS`, `ray job submit`).
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from opkd_mcore.config import dump_config, launch_world_size
from opkd_mcore.config.placement_rules import engines_sleep_while_training
from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.controller.data_plane import PromptQueue
from opkd_mcore.controller.groups import (
    ActorLost,
    Gather,
    StageFailed,
    TrainerDied,
    WorkerGroups,
    await_named,
)
from opkd_mcore.controller.placement import cpus_needed
from opkd_mcore.controller.schedules import RolloutFeed, StepWork
from opkd_mcore.controller.trainer_worker import TrainBatch
from opkd_mcore.data import PromptSampler
from opkd_mcore.data.rewards import TaskRewards
from opkd_mcore.train import stages
from opkd_mcore.train.checkpoint import (
    TrainerState,
    latest_checkpoint,
    prepare_run_dir,
    rollout_version_on_resume,
)
from opkd_mcore.train.components import load_train_data, record_skipped
from opkd_mcore.train.loop import encode_prompts
from opkd_mcore.train.metrics import MetricsLogger
from opkd_mcore.train.samples_log import SampleRecord, SamplesLog
from opkd_mcore.train.step_report import PromptSamples, sample_records, sampling_config, step_metrics

logger = logging.getLogger(__name__)

# what a reused `WorkerGroups` was built from: a run on the same actors must not change it (the
# rollout section's sampling fields are sent with every call and may differ)
WORKLOAD_SECTIONS = ("model", "parallel", "loss", "teacher", "weight_sync", "optim", "controller")
ENGINE_ROLLOUT_FIELDS = ("max_model_len", "gpu_memory_utilization", "enforce_eager", "seed")


class RayController:
    """One run on Ray. `groups`: reuse the actors of an earlier run of the same workload (its
    trainer is reset to the initial checkpoint). `on_event(name, info)` observes the feed (tests
    inject faults through it): "rollout_submitted" {engine, step, prompts}, "rollout_died" {engine,
    prompts}, "teacher_submitted" {teacher, replica, step, call}, "step_done" {step, metrics}."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, export_only: bool = False,
                 overwrite: bool = False, groups: WorkerGroups | None = None,
                 on_event: Callable[[str, dict], None] | None = None):
        self.cfg, self.resume, self.export_only = cfg, resume or export_only, export_only
        self.overwrite = overwrite  # a fresh run replaces an earlier run's output in run.output_dir
        self.on_event = on_event
        self.owns_groups = groups is None
        if groups is not None:
            changed = [s for s in WORKLOAD_SECTIONS if getattr(groups.cfg, s) != getattr(cfg, s)]
            changed += [f"rollout.{f}" for f in ENGINE_ROLLOUT_FIELDS
                        if getattr(groups.cfg.rollout, f) != getattr(cfg.rollout, f)]
            if changed:
                raise ValueError(f"groups: built for another workload (sections {changed} differ)")
        self.groups = groups
        # the data before any actor or engine: a bad row or an overlong prompt is refused here
        self.tokenizer, self.train_set, self.skipped = load_train_data(cfg)

    # ---- set-up ----------------------------------------------------------------------------
    def _data(self) -> PromptQueue:
        cfg, train_set = self.cfg, self.train_set
        record_skipped(cfg, train_set, self.skipped)
        sampler = PromptSampler(len(train_set), cfg.rollout.prompts_per_step, seed=cfg.data.seed,
                                shuffle=cfg.data.shuffle)

        def draw(indices, batch):
            return encode_prompts(cfg, self.tokenizer, train_set, indices, batch)

        return PromptQueue(draw, sampler, len(train_set), cfg.rollout.prompts_per_step)

    def _on_trainers(self, method: str, *args, what: str | None = None) -> list:
        named = {f"trainer rank {r}": getattr(t, method).remote(*args)
                 for r, t in enumerate(self.groups.trainers)}
        try:
            done = await_named(named, self.cfg.controller.call_timeout_s, what or method)
        except ActorLost as err:
            raise self._trainer_died(err) from err
        return [done[name] for name in named]

    def _on_engines(self, method: str) -> list:
        named = {f"rollout engine {e}": getattr(r, method).remote()
                 for e, r in enumerate(self.groups.rollouts)}
        done = await_named(named, self.cfg.controller.call_timeout_s, f"rollout engines {method}")
        return [done[name] for name in named]

    def _trainer_died(self, err: Exception) -> TrainerDied:
        last = latest_checkpoint(self.cfg.run.output_dir)
        return TrainerDied(f"{err}; the run stops. The last complete checkpoint ({last or 'none yet'}) is "
                           "intact: continue with --resume")

    def _restore(self, queue: PromptQueue) -> TrainerState:
        state = TrainerState()
        if self.resume:
            state = TrainerState(**self._on_trainers("load", self.cfg.run.output_dir)[0])
            queue.load_state_dict(state.sampler)
            logger.info("resumed from %s (step %d, weight version %d): %d prompts in flight at the "
                        "checkpoint are generated again", latest_checkpoint(self.cfg.run.output_dir),
                        state.step, state.weight_version, len(queue.outstanding))
            # fresh engines hold the initial checkpoint: give them the restored student
            state.weight_version = rollout_version_on_resume(state, self.cfg.weight_sync.every_steps)
            if not self.export_only:
                self.groups.sync(state.weight_version)
        elif not self.owns_groups:  # a reused trainer starts over from the initial checkpoint
            self.groups.close_weight_sync()  # both ends together, before the trainer rebuilds its model
            self._on_trainers("reset")
            self.groups.connect_weight_sync()  # the new model's tensors, not the old ones
            self.groups.sync(0)
        return state

    # ---- the run ---------------------------------------------------------------------------
    def run(self) -> list[dict]:
        cfg, out = self.cfg, self.cfg.run.output_dir
        self.config_yaml = dump_config(cfg)
        prepare_run_dir(cfg, resume=self.resume and not self.export_only, export_only=self.export_only,
                        overwrite=self.overwrite)
        queue = self._data()
        if self.groups is None:
            self.groups = WorkerGroups(cfg, launch_world_size(cfg))
        try:
            state = self._restore(queue)
            history = [] if self.export_only else self._train(queue, state)
            if cfg.checkpoint.export_hf_at_end or self.export_only:
                self._on_trainers("export_hf", out)
            return history
        finally:
            if self.owns_groups:
                self.groups.shutdown()

    def _train(self, queue: PromptQueue, state: TrainerState) -> list[dict]:
        cfg, out = self.cfg, self.cfg.run.output_dir
        log = MetricsLogger(out, cfg.logging, cfg.run.steps, start_step=state.step)
        samples_log = SamplesLog(out, start_step=state.step)
        dump_config(cfg, os.path.join(out, "config.yaml"))
        self.rewards = None
        if cfg.loss.task_reward_coef:
            self.rewards = TaskRewards(cfg.data.rewards)
        feed = RolloutFeed(cfg, self.groups, queue, version=state.weight_version, step=state.step,
                           sampling=sampling_config(cfg), on_event=self.on_event)
        history, ckpt = [], cfg.checkpoint
        while state.step < cfg.run.steps:
            step = state.step
            metrics, records = self._step(feed, queue, state)
            samples_log.write(records)
            log.log(step, metrics)
            history.append({"step": step, **metrics})
            if self.on_event:
                self.on_event("step_done", {"step": step, "metrics": metrics})
            if ckpt.save_every and state.step % ckpt.save_every == 0:
                self._save(feed, queue, state)
        if ckpt.save_at_end and history and (not ckpt.save_every or state.step % ckpt.save_every):
            self._save(feed, queue, state)
        log.close()
        return history

    def _save(self, feed: RolloutFeed, queue: PromptQueue, state: TrainerState) -> None:
        state.sampler = queue.state_dict()  # the sampler position and every prompt not yet trained
        refs = {f"trainer rank {r}": t.save.remote(self.cfg.run.output_dir, asdict(state), self.config_yaml,
                                                  self.cfg.checkpoint.keep_last)
                for r, t in enumerate(self.groups.trainers)}
        self._await_while_feeding(feed, refs, "checkpoint")

    def _await_while_feeding(self, feed: RolloutFeed, named: dict, what: str,
                             timeout_s: float | None = None) -> dict:
        """Wait for named calls while the feed keeps generating and scoring."""
        gather = Gather(named, what, timeout_s or self.cfg.controller.call_timeout_s)
        while not gather.done():
            gather.take(feed.process_finished(also=gather.pending, timeout=min(1.0, gather.remaining())))
        try:
            return gather.result()
        except ActorLost as err:
            if err.member.startswith("trainer"):
                raise self._trainer_died(err) from err
            raise

    # ---- one step --------------------------------------------------------------------------
    def _step(self, feed: RolloutFeed, queue: PromptQueue,
              state: TrainerState) -> tuple[dict[str, float], list[SampleRecord]]:
        cfg, start = self.cfg, time.perf_counter()
        step, version_trained = state.step, feed.version
        work = feed.take_batch(step)
        sleeping = engines_sleep_while_training(cfg)
        if sleeping:  # the engines leave the shared devices to the trainer until the next sync
            self._on_engines("sleep")
        batch = self._batch(feed, work, step)
        extra = {}
        if self.rewards is not None:
            scored = stages.ScoredBatch(samples=batch.samples, teacher=[None] * len(batch.samples))
            extra = stages.reward_stage(scored, self.rewards, self.tokenizer)
            batch.task_advantages = scored.task_advantages
        timings = self._stage_seconds(feed, work)
        refs = {f"trainer rank {r}": t.train.remote(batch) for r, t in enumerate(self.groups.trainers)}
        feed.steps_since_sync += 1
        done = self._await_while_feeding(feed, refs, f"train step {step}")
        replies = [done[name] for name in refs]  # rank 0 first: it reports the batch's metrics
        feed.mark_trained(work)
        queue.trained([g.job for g in work.groups])
        records = self._records(step, work, version_trained)
        state.step += 1
        sync_s = 0.0
        if sleeping:
            self._on_engines("wake_up")
        if state.step % cfg.weight_sync.every_steps == 0 and feed.steps_since_sync:
            sync_s = self._sync(feed, feed.version + 1)
        state.weight_version = feed.version
        feed.steps_trained = state.step
        feed.release_deferred()
        step_s = time.perf_counter() - start
        train_s = max(r.seconds for r in replies)
        # trainer rank 0's reply carries the optimizer step's metrics and the rollout metrics
        metrics = step_metrics({**replies[0].metrics, **extra, **timings}, train_s=train_s, sync_s=sync_s,
                               step_s=step_s, weight_version=feed.version)
        trained = [r for r in records if not r.dropped]
        lags = [r.version_trained - r.version_generated for r in trained]
        busy = timings["timing/rollout"] + timings["timing/teacher"] + train_s + sync_s
        metrics.update({  # what only the overlapped schedules have
            "timing/teacher_fetch": max(r.fetch_seconds for r in replies),
            "timing/wait_rollout": work.wait_rollout, "timing/wait_teacher": work.wait_teacher,
            "timing/wait_train": feed.take_idle_seconds(),
            "perf/overlap": 1.0 - step_s / busy if busy > 0 else 0.0,
            "async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags)),
            "async/dropped": float(len(records) - len(trained)),
            "faults/requeued_prompts": float(feed.requeued),
            "faults/rollout_restarts": float(self.groups.restarts["rollout"]),
            "faults/teacher_restarts": float(self.groups.restarts["teacher"]),
        })
        return metrics, records

    def _batch(self, feed: RolloutFeed, work: StepWork, step: int) -> TrainBatch:
        samples, rows, stale = [], [], []
        for position, (group, is_stale) in enumerate(zip(work.groups, work.stale)):
            samples += [replace(s, group_id=position) for s in group.samples]
            rows += group.teacher_rows
            stale += [is_stale] * len(group.samples)
        calls = {c: feed.teacher_calls[c].rows for c in {r[0] for r in rows if r is not None}}
        return TrainBatch(step=step, samples=samples, rows=rows, teacher_calls=calls, stale=stale,
                          is_truncation=self.cfg.run.is_truncation)

    def _stage_seconds(self, feed: RolloutFeed, work: StepWork) -> dict[str, float]:
        """This batch's rollout and teacher seconds, per engine / per teacher actor (their shares of
        the calls that served it), for `perf/overlap` = 1 - step / (sum of the stages)."""
        rollout = sum(g.seconds for g in work.groups) / len(self.groups.rollouts)
        teacher = 0.0
        for g in work.groups:
            for r in g.teacher_rows:
                if r is not None:
                    call = feed.teacher_calls[r[0]]
                    teacher += (call.seconds or 0.0) / len(call.members)
        actors = sum(len(a) for a in self.groups.teachers.values())
        return {"timing/rollout": rollout, "timing/teacher": teacher / max(actors, 1)}

    def _records(self, step: int, work: StepWork, version_trained: int) -> list[SampleRecord]:
        """The batch's trained groups, then those dropped on the way."""
        groups = [PromptSamples(prompt_index=g.job.prompt_index, epoch=g.job.epoch, samples=g.samples,
                                token_versions=g.token_versions, dropped=reason)
                  for g, reason in [*((g, None) for g in work.groups), *work.dropped]]
        return sample_records(step, groups, version_trained, self.cfg.teacher.teachers)

    def _sync(self, feed: RolloutFeed, version: int) -> float:
        """Weights to every engine as `version`, generation going on meanwhile (async). A dead engine
        is brought back and the sync done again; a dead trainer rank stops the run."""
        start = time.perf_counter()
        abort = self.cfg.run.in_flight_update == "abort_resume"
        try:
            sync = self.groups.start_sync(version, abort)
            if self.on_event:
                self.on_event("sync_started", {"version": version})
            self._await_while_feeding(feed, sync,
                                f"weight sync v{version} over {self.groups.describe_groups()}",
                                timeout_s=2 * self.cfg.controller.sync_timeout_s)
        except (ActorLost, StageFailed) as err:
            logger.warning("controller: %s; rebuilding the weight-sync groups", err)
            if isinstance(err, ActorLost) and err.member.startswith("rollout engine"):
                self.groups.restarts["rollout"] += 1
            # the dead engine's end never closes; trainer ranks still sending abort theirs now
            try:
                self.groups.abort_trainer_weight_sync()
            except ActorLost as lost:
                raise self._trainer_died(lost) from lost
            self.groups.rebuild_weight_sync(version)
        feed.version, feed.steps_since_sync = version, 0
        return time.perf_counter() - start


def train_with_ray(cfg: TrainConfig, *, resume: bool = False, export_only: bool = False,
                   overwrite: bool = False) -> list[dict]:
    """`opkd train` with `controller.kind: ray`: attach to the cluster of `RAY_ADDRESS` (as under
    `ray job submit`), else start a local one that declares enough CPUs for every actor."""
    import ray

    # built before the cluster starts: it reads and checks the data files first
    controller = RayController(cfg, resume=resume, export_only=export_only, overwrite=overwrite)
    started = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # attach (ray job submit sets it); the cluster has its resources
            ray.init()
        else:
            # a cluster of its own (never another run's), declaring the CPUs the actors reserve:
            # Ray places by declared resources, not by load
            ray.init(address="local", include_dashboard=False,
                     num_cpus=max(os.cpu_count() or 1, math.ceil(cpus_needed(cfg, launch_world_size(cfg)))))
        started = True
    try:
        return controller.run()
    except TrainerDied as err:
        logger.error("%s", err)
        raise
    finally:
        if started:
            ray.shutdown()
