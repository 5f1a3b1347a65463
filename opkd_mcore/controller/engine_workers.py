"""Actors of the rollout and teacher groups.

`RolloutEngineWorker` holds one vLLM rollout engine (built by `train.components.build_rollout`, as on
the torchrun path) and its end of the weight-sync group. Generation and weight updates run on
different actor threads and meet at a gate:

* `finish`: an update waits until the generate calls in flight have returned, and new calls wait
  until it is done, so every response comes from one weight version;
* `abort_resume` (partial rollout): generate calls run in chunks of `run.partial_rollout_tokens`
  tokens; an update pauses the engine between two chunks, and the responses continue on the new
  weights. Each token's version is kept (`token_versions`), and a response's `weight_version` is
  the oldest of them (what its staleness is measured by).

`TeacherWorker` holds one scoring teacher (built by `train.teacher_setup`) and returns its rows as a
separate object: the driver keeps the reference and passes it to the trainer ranks, which pull it.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from opkd_mcore.config.placement_rules import engines_sleep_while_training
from opkd_mcore.rollout import Sample
from opkd_mcore.rollout.vllm_rollout import sample_seed
from opkd_mcore.train.components import build_rollout
from opkd_mcore.train.teacher_setup import build_scoring_teacher
from opkd_mcore.weight_sync.transport import TransportConfig
from opkd_mcore.weight_sync.vllm_handle import VllmReceiverHandle

logger = logging.getLogger(__name__)


@dataclass
class GenReply:
    """One generate call's result: per job, its n samples and their token-version runs."""

    samples: list[list[Sample]]  # one list per job, sample j of job i = its j-th sample
    # per job, per sample: [[version, tokens], ...] when the response spans weight versions, else None
    token_versions: list[list[list[list[int]] | None]]
    seconds: float


def _runs(versions: list[int]) -> list[list[int]] | None:
    """[[version, count], ...] of a token-version list, or None when it holds one version."""
    if len(set(versions)) <= 1:
        return None
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


class RolloutEngineWorker:
    """Body of one rollout actor (made remote by `controller.groups`, with a few threads)."""

    def __init__(self, cfg, engine_index: int):
        self.cfg, self.index = cfg, engine_index
        self.engine = build_rollout(cfg, tensor_parallel_size=cfg.controller.rollout_tp,
                                    sleep_mode=engines_sleep_while_training(cfg))
        # the rollout salts its prefix cache with the weight version: no reset per sync
        self.handle = VllmReceiverHandle(self.engine.llm, reset_prefix_cache=False)
        self._gate = threading.Condition()
        self._requests = 0  # generate calls in flight
        self._updating = False  # a weight update or group join holds new generate calls back
        self._generating = threading.Lock()  # one vllm.LLM call sequence at a time

    def ping(self) -> int:
        return self.engine.weight_version

    # ---- the gate between generation and weight updates --------------------------------------
    def _begin_request(self) -> None:
        with self._gate:
            self._gate.wait_for(lambda: not self._updating)
            self._requests += 1

    def _end_request(self) -> None:
        with self._gate:
            self._requests -= 1
            self._gate.notify_all()

    def _hold_requests(self, wait_for_in_flight: bool) -> None:
        with self._gate:
            self._gate.wait_for(lambda: not self._updating)  # one update at a time
            self._updating = True
            if wait_for_in_flight:
                self._gate.wait_for(lambda: self._requests == 0)

    def _release_requests(self) -> None:
        with self._gate:
            self._updating = False
            self._gate.notify_all()

    # ---- generation --------------------------------------------------------------------------
    def generate(self, jobs: list, sampling, segment_tokens: int | None = None) -> GenReply:
        """n samples for each `PromptJob`, seeded by the job's seed; `segment_tokens` set: in chunks
        that a weight update may fall between (abort_resume)."""
        start = time.perf_counter()
        self._begin_request()
        try:
            with self._generating:
                if segment_tokens is None:
                    samples = self.engine.generate([j.prompt_ids for j in jobs], sampling,
                                                   data=[j.data for j in jobs], seeds=[j.seed for j in jobs])
                    for s in samples:
                        s.teacher_prompt_ids = jobs[s.group_id].teacher_prompt_ids
                    per_job = [[s for s in samples if s.group_id == i] for i in range(len(jobs))]
                    return GenReply(per_job, [[None] * len(g) for g in per_job], time.perf_counter() - start)
                per_job, versions = self._generate_in_segments(jobs, sampling, segment_tokens)
        finally:
            self._end_request()
        return GenReply(per_job, versions, time.perf_counter() - start)

    def _generate_in_segments(self, jobs, sampling, segment_tokens: int):
        seqs = [{"job": i, "j": j, "ids": [], "lps": [], "vers": [], "finish": None}
                for i in range(len(jobs)) for j in range(sampling.n)]
        segment = 0
        while active := [s for s in seqs if s["finish"] is None]:
            budget = min(segment_tokens, sampling.max_new_tokens - len(active[0]["ids"]))
            one = dataclasses.replace(sampling, n=1, max_new_tokens=budget)
            seeds = [sample_seed(jobs[s["job"]].seed, s["j"], segment) for s in active]
            prompts = [jobs[s["job"]].prompt_ids + s["ids"] for s in active]  # each continues its response
            outs = self.engine.generate(prompts, one, seeds=seeds)
            for s, out in zip(active, outs):  # one sample per request, in request order
                s["ids"] += out.response_ids
                # None throughout where the engine is not asked for them (nothing reads them)
                s["lps"] = None if out.response_logprobs is None else s["lps"] + out.response_logprobs
                s["vers"] += [out.weight_version] * len(out.response_ids)
                if out.finish_reason != "length" or len(s["ids"]) >= sampling.max_new_tokens:
                    s["finish"] = out.finish_reason
            segment += 1
        per_job = [[] for _ in jobs]
        versions = [[] for _ in jobs]
        for s in seqs:
            job = jobs[s["job"]]
            per_job[s["job"]].append(Sample(
                prompt_ids=list(job.prompt_ids), response_ids=s["ids"], response_logprobs=s["lps"],
                finish_reason=s["finish"], weight_version=min(s["vers"], default=self.engine.weight_version),
                group_id=s["job"], data=dict(job.data), teacher_prompt_ids=job.teacher_prompt_ids))
            versions[s["job"]].append(_runs(s["vers"]))
        return per_job, versions

    # ---- weight sync -------------------------------------------------------------------------
    def join_weight_sync(self, groups: list[dict], rank_offset: int, transport: str) -> int:
        """Join the (re)built weight-sync groups once the generate calls in flight have returned."""
        self._hold_requests(wait_for_in_flight=True)
        try:
            configs = [TransportConfig(**g) for g in groups]
            return self.handle.join_async(configs, rank_offset=rank_offset, transport=transport).result()
        finally:
            self._release_requests()

    def close_weight_sync(self) -> None:
        """Leave the weight-sync groups (together with the trainer ranks: see
        `WorkerGroups.close_weight_sync`)."""
        self._hold_requests(wait_for_in_flight=True)
        try:
            self.handle.leave()
        finally:
            self._release_requests()

    def receive_weights(self, version: int, abort_in_flight: bool = False) -> int:
        """Receive `version` from the trainer's stage owners; see the module docstring for the gate."""
        self._hold_requests(wait_for_in_flight=not abort_in_flight)
        try:
            if abort_in_flight:
                self.engine.pause()  # returns once the chunk being generated has finished
            try:
                loaded = self.handle.receive_async(version).result()
                if set(loaded) != {version}:
                    raise RuntimeError(f"rollout engine {self.index}: workers report weight versions "
                                       f"{loaded}, expected {version}")
                self.engine.set_weight_version(version, engine_stamped=True)
            finally:
                if abort_in_flight:
                    self.engine.resume()
        finally:
            self._release_requests()
        return version

    # ---- colocated: the trainer's device is shared ------------------------------------------
    def sleep(self) -> bool:
        """Free the KV cache and offload the weights while the trainer trains (True when the
        platform freed memory; where the engine has no sleep mode, as on CPU, nothing happens)."""
        if not self.engine.sleep_supported:
            return False
        return self.engine.sleep(level=1)

    def wake_up(self) -> None:
        if self.engine.sleep_supported:
            self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.shutdown()


class TeacherWorker:
    """Body of one scoring-teacher actor: the teacher `name` (at `url`, for a remote replica)."""

    def __init__(self, cfg, name: str, url: str | None, student_vocab: int):
        endpoint = next(t for t in cfg.teacher.teachers if t.name == name)
        one = dataclasses.replace(endpoint, url=url or endpoint.url, replica_urls=[])
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, teachers=[one]))
        self.name = name
        self.teacher = build_scoring_teacher(cfg, student_vocab)

    def ping(self) -> str:
        return self.name

    def score(self, sequences: list[list[int]]):
        """(rows, seconds): call with `num_returns=2` so that the rows are an object of their own."""
        start = time.perf_counter()
        rows = self.teacher.score(sequences)
        return rows, time.perf_counter() - start

    def shutdown(self) -> None:
        self.teacher.close()
