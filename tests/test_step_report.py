"""The step report both launchers share (`train/step_report.py`) and the teacher interface the
teacher stage scores through (`teacher.base.SampleScorer`), without engines."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import opkd_mcore.controller.driver as driver
from opkd_mcore.config import load_config
from opkd_mcore.config.schema import TeacherEndpoint
from opkd_mcore.controller.data_plane import GroupResult, PromptJob
from opkd_mcore.controller.driver import RayController
from opkd_mcore.controller.schedules import StepWork
from opkd_mcore.losses import TopKTeacher
from opkd_mcore.rollout import Sample, SamplingConfig
from opkd_mcore.teacher.base import SampleScorer, Teacher
from opkd_mcore.teacher.router import TeacherRouter
from opkd_mcore.train import stages
from opkd_mcore.train.checkpoint import TrainerState
from opkd_mcore.train.loop import DistillationRun
from opkd_mcore.train.samples_log import SamplesLog, read_samples
from opkd_mcore.train.step_report import (
    PromptSamples,
    prompt_groups,
    sample_records,
    sampling_config,
    step_metrics,
)

TEACHERS = [TeacherEndpoint(name="math", data_sources=["gsm8k"]), TeacherEndpoint(name="chat")]


def _cfg(*overrides):
    return load_config(None, ["model.student=Qwen/Qwen3-0.6B", "teacher.teachers.0.model=Qwen/Qwen3-0.6B",
                              "loss.support=teacher", *overrides], check_files=False)


def _sample(group_id: int, version: int = 0, teacher: str | None = None, response=(5, 6)) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=list(response), response_logprobs=[-0.5] * len(response),
                  finish_reason="stop", weight_version=version, group_id=group_id,
                  data={"teacher": teacher} if teacher else {})


def test_sampling_config_is_the_rollout_section():
    cfg = _cfg("rollout.n=3", "parallel.global_batch_size=12", "rollout.temperature=0.7", "rollout.top_p=0.9",
               "rollout.top_k=5", "rollout.max_new_tokens=7", "rollout.seed=11")
    # the run's seed reaches the engine per prompt (with the prompts), never as one batch seed
    # (no sampler logprobs: the logit-form loss reads none)
    assert sampling_config(cfg) == SamplingConfig(n=3, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7,
                                                  logprobs=False)


def test_step_metrics_add_timings_throughput_and_version_to_the_stages():
    measured = {"train/loss": 1.5, "rollout/response_tokens": 30.0, "timing/rollout": 0.5,
                "timing/teacher": 0.25}
    metrics = step_metrics(measured, train_s=1.0, sync_s=0.125, step_s=2.0, weight_version=3)
    assert metrics == {**measured, "timing/train": 1.0, "timing/weight_sync": 0.125, "timing/step": 2.0,
                       "rollout/weight_version": 3.0, "perf/tokens_per_s": 15.0}
    with pytest.raises(KeyError, match="rollout/response_tokens"):
        step_metrics({"train/loss": 1.5}, train_s=1.0, sync_s=0.0, step_s=2.0, weight_version=0)


def test_prompt_groups_follow_group_ids():
    samples = [_sample(0), _sample(0), _sample(1), _sample(1)]
    groups = prompt_groups([7, 2], [0, 1], samples)
    assert [(g.prompt_index, g.epoch) for g in groups] == [(7, 0), (2, 1)]
    assert [[id(s) for s in g.samples] for g in groups] == [[id(s) for s in samples[:2]],
                                                           [id(s) for s in samples[2:]]]


def test_sample_records_of_trained_and_dropped_groups():
    trained = PromptSamples(prompt_index=4, epoch=0, samples=[_sample(0, version=2, teacher="math"),
                                                               _sample(0, version=1, teacher="math")],
                            token_versions=[None, [[1, 1], [2, 1]]])
    dropped = PromptSamples(prompt_index=9, epoch=1, samples=[_sample(1, version=0)], dropped="stale")
    lines = [json.loads(r.to_json()) for r in sample_records(5, [trained, dropped], 3, TEACHERS)]
    base = {"step": 5, "version_trained": 3}
    assert lines == [
        {**base, "prompt_index": 4, "epoch": 0, "sample_index": 0, "version_generated": 2, "teacher": "math",
         "dropped": False, "reason": None},
        {**base, "prompt_index": 4, "epoch": 0, "sample_index": 1, "version_generated": 1, "teacher": "math",
         "dropped": False, "reason": None, "token_versions": [[1, 1], [2, 1]]},
        {**base, "prompt_index": 9, "epoch": 1, "sample_index": 0, "version_generated": 0, "teacher": "chat",
         "dropped": True, "reason": "stale"},
    ]


def test_both_launchers_write_the_same_samples_lines(tmp_path, monkeypatch):
    """One in-order batch, logged by the torchrun loop and by the Ray driver: the same lines."""
    cfg = _cfg("teacher.teachers.0.name=math", "teacher.teachers.0.data_sources=[gsm8k]")
    cfg.teacher.teachers.append(TeacherEndpoint(name="chat", backend="remote", url="http://a:1"))
    samples = [_sample(0, teacher="math"), _sample(0, teacher="math"), _sample(1), _sample(1)]
    indices, epochs = [3, 0], [0, 1]  # the second prompt is the first of the next epoch
    run = DistillationRun(cfg=cfg, engine=None, chunks=[], rollout=None, teacher=None, syncer=None,
                          tokenizer=None, dataset=range(4), sampler=None, shard=stages.ShardLayout(), loss_plan=None,
                          state=TrainerState(step=6, weight_version=2),
                          samples_log=SamplesLog(str(tmp_path / "torchrun")))
    run._log_samples(stages.PromptBatch(indices=indices, prompt_ids=[[1, 2]] * 2, data=[{}, {}]),
                     {"epoch": 0, "position": 3}, stages.ScoredBatch(samples=samples, teacher=[None] * 4))
    jobs = [PromptJob(prompt_index=i, epoch=e, batch=6, position=p, seed=0, prompt_ids=[1, 2],
                      data=samples[2 * p].data) for p, (i, e) in enumerate(zip(indices, epochs))]
    work = StepWork(groups=[GroupResult(job=j, samples=samples[2 * p:2 * p + 2], token_versions=[None] * 2,
                                        seconds=0.0) for p, j in enumerate(jobs)])
    ray_log = SamplesLog(str(tmp_path / "ray"))
    # the controller reads the data files when it is built; this config names none it could read
    monkeypatch.setattr(driver, "load_train_data", lambda cfg: (None, None, []))
    ray_log.write(RayController(cfg)._records(6, work, 2))
    torchrun = read_samples(str(tmp_path / "torchrun"))
    assert [(r["prompt_index"], r["epoch"], r["teacher"]) for r in torchrun] == \
           [(3, 0, "math"), (3, 0, "math"), (0, 1, "chat"), (0, 1, "chat")]
    assert torchrun == read_samples(str(tmp_path / "ray"))


class _Tagged(Teacher):
    """Answers every sequence with one top-k row per position whose logprob is -tag."""

    def __init__(self, tag: float):
        self.tag, self.calls = tag, []

    @property
    def address(self) -> str:
        return f"tagged-{self.tag}"

    def score(self, sequences):
        self.calls.append(len(sequences))
        return [TopKTeacher(ids=torch.zeros(len(s) - 1, 1, dtype=torch.int64),
                            logprobs=torch.full((len(s) - 1, 1), -self.tag)) for s in sequences]


def test_teacher_stage_routes_through_the_scorer_interface():
    samples = [_sample(0, teacher="math"), _sample(1, teacher="chat"), _sample(2)]
    batch = stages.RolloutBatch(samples=samples)
    single = _Tagged(1.0)
    scored = stages.teacher_stage(single, batch)
    assert [float(r.logprobs[0, 0]) for r in scored.teacher] == [-1.0] * 3 and single.calls == [3]
    router = TeacherRouter({"math": _Tagged(2.0), "chat": _Tagged(3.0)}, field="teacher", default="chat")
    assert isinstance(router, SampleScorer) and isinstance(single, SampleScorer)
    scored = stages.teacher_stage(router, batch)
    assert [float(r.logprobs[0, 0]) for r in scored.teacher] == [-2.0, -3.0, -3.0]
    assert stages.teacher_stage(None, batch).teacher == [None] * 3
    with pytest.raises(TypeError):
        SampleScorer()  # the interface itself scores nothing


@pytest.mark.parametrize("overrides, reads", [
    ((), False),  # the logit-form KD loss reads no sampler logprobs
    (("loss.form=policy_gradient", "loss.support=null"), True),  # its importance ratio does
    (("controller.kind=ray", "run.schedule=async", "run.stale_policy=truncated_is"), True),  # IS weights
])
def test_the_rollout_is_asked_for_logprobs_only_where_they_are_read(overrides, reads):
    assert sampling_config(_cfg(*overrides)).logprobs is reads


def test_samples_without_sampler_logprobs_pack_without_them():
    samples = [dataclasses.replace(_sample(0), response_logprobs=None), _sample(1)]
    assert stages._sampler_logprobs(samples) is None
    assert stages._sampler_logprobs([_sample(0), _sample(1)]) == [[-0.5, -0.5], [-0.5, -0.5]]
