"""The Ray controller's bookkeeping without a cluster: config checks, the exactly-once prompt queue
(draw, hand back, checkpoint, restore), the async staleness policy, samples.jsonl and its audit,
hang messages, and the truncated importance weights on a real Megatron student (one gloo rank)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from opkd_mcore.config import ConfigError, load_config
from opkd_mcore.config.schema import TeacherEndpoint
from opkd_mcore.controller.data_plane import GroupResult, PromptQueue
from opkd_mcore.data import PromptSampler
from opkd_mcore.rollout import Sample
from opkd_mcore.train.samples_log import SamplesLog, audit, draw_epochs, read_samples
from opkd_mcore.train.stages import PromptBatch
from opkd_mcore.train.step_report import prompt_groups, sample_records

BASE = ["model.student=Qwen/Qwen3-0.6B", "teacher.teachers.0.model=Qwen/Qwen3-0.6B", "loss.support=teacher",
        "parallel.global_batch_size=8"]


def _cfg(*overrides):
    return load_config(None, BASE + list(overrides), check_files=False)


@pytest.mark.parametrize("overrides, message", [
    (["run.schedule=async"], "^run.schedule: 'async' .* needs controller.kind: ray"),
    (["run.schedule=one_step_off", "controller.kind=ray", "controller.placement=colocated", "run.device=cuda",
      "rollout.gpu_memory_utilization=0.5"],
     r"^rollout.gpu_memory_utilization: 2 vLLM engines stay on one colocated device .* one_step_off .* "
     r"expected below 0.50"),
    (["run.in_flight_update=abort_resume", "controller.kind=ray"], "^run.in_flight_update: only the async"),
    (["run.schedule=async", "controller.kind=ray", "weight_sync.every_steps=2"], "^weight_sync.every_steps"),
    (["run.max_staleness=-1"], "^run.max_staleness: expected >= 0"),
    (["run.is_truncation=0.5"], "^run.is_truncation: expected >= 1"),
    (["run.stale_policy=clip"], "^run.stale_policy: expected one of"),
    (["controller.kind=slurm"], "^controller.kind: expected one of"),
    (["controller.kind=ray", "controller.rollout_engines=0"], "^controller.rollout_engines: expected > 0"),
    (["controller.kind=ray", "weight_sync.transport=colocated_ipc"], "^weight_sync.transport: colocated_ipc"),
    (["controller.kind=ray", "controller.placement=colocated", "controller.rollout_engines=2"],
     "^controller.rollout_engines: colocated engines"),
    (["controller.kind=ray", "controller.placement=colocated", "weight_sync.transport=group",
      "run.device=cuda"],
     "^weight_sync.transport: group puts colocated engine 0 on trainer rank 0's device"),
])
def test_schedule_and_controller_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


def test_colocated_engines_sleep_under_sync_and_stay_beside_an_overlapped_trainer():
    from opkd_mcore.config.placement_rules import engines_sleep_while_training, resident_vllm_engines

    colocated = ["controller.kind=ray", "controller.placement=colocated", "run.device=cuda"]
    sync = _cfg(*colocated)
    assert engines_sleep_while_training(sync) and resident_vllm_engines(sync) == 1  # the vLLM teacher
    overlapped = _cfg(*colocated, "run.schedule=one_step_off", "rollout.gpu_memory_utilization=0.3")
    assert not engines_sleep_while_training(overlapped) and resident_vllm_engines(overlapped) == 2
    in_step = _cfg(*colocated, "run.schedule=one_step_off", "teacher.teachers.0.backend=megatron",
                   "loss.support=null", "rollout.gpu_memory_utilization=0.6")
    assert resident_vllm_engines(in_step) == 1  # the rollout engine; the teacher runs in the trainer
    assert not engines_sleep_while_training(_cfg("run.schedule=one_step_off", "controller.kind=ray"))
    # teacher actors are dealt over the bundles in teacher_actor_endpoints order, remote ones included:
    # two ranks, a remote teacher (bundle 0), the vLLM one (bundle 1), the one engine (bundle 0)
    two = _cfg(*colocated, "run.schedule=one_step_off", "parallel.world_size=2", "parallel.micro_batch_size=2",
               "teacher.teachers.0.backend=remote", "teacher.teachers.0.url=http://a:1", "teacher.teachers.0.name=r")
    two.teacher.teachers.append(type(two.teacher.teachers[0])(name="v", backend="vllm", model="Qwen/Qwen3-0.6B"))
    assert resident_vllm_engines(two) == 1


def test_ray_world_is_one_model_parallel_replica_unless_set():
    from opkd_mcore.config import launch_world_size

    assert launch_world_size(_cfg("controller.kind=ray", "parallel.tp=2")) == 2
    four = _cfg("controller.kind=ray", "parallel.world_size=4", "parallel.micro_batch_size=2")
    assert launch_world_size(four) == 4
    for schedule in ("one_step_off", "two_step_off", "async"):
        assert _cfg("controller.kind=ray", f"run.schedule={schedule}").run.schedule == schedule


# ---------------------------------------------------------------- the prompt queue
def _queue(size=7, batch=3, seed=0):
    def draw(indices, number):  # seeds like train.loop.encode_prompts: (draw number, position)
        return PromptBatch(indices=list(indices), prompt_ids=[[1, 3 + i] for i in indices],
                           data=[{"i": i} for i in indices],
                           seeds=[1000 * number + j for j in range(len(indices))])

    return PromptQueue(draw, PromptSampler(size, batch, seed=seed), size, batch)


def test_queue_draws_in_sampler_order_and_hands_back_first():
    queue, reference = _queue(), PromptSampler(7, 3, seed=0)
    first = queue.take(2)
    second = queue.take(2)  # one left over from the first draw, then a new draw
    expected = reference.next_batch() + reference.next_batch()
    assert [j.prompt_index for j in first + second] == expected[:4]
    assert [(j.batch, j.position, j.seed) for j in first + second] == \
           [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 1000)]
    queue.requeue(first[1:])  # dropped as stale: served before anything else, with its seed
    again = queue.take(2)
    assert again[0] is first[1] and again[1].prompt_index == expected[4]
    queue.trained([first[0], *second])
    with pytest.raises(RuntimeError, match="handed to the trainer twice"):
        queue.trained([first[0]])
    with pytest.raises(RuntimeError, match="not outstanding"):
        queue.requeue([first[0]])


def test_queue_checkpoint_restores_outstanding_prompts_exactly_once():
    queue = _queue()
    taken = queue.take(5)  # prompts 0..4 of the draw order are in flight
    queue.trained(taken[:2])
    queue.requeue([taken[3]])  # handed back: waits, still outstanding
    state = json.loads(json.dumps(queue.state_dict()))  # what trainer_state.json holds
    assert {"epoch", "position"} <= set(state)  # PromptSampler's own keys stay readable

    restored = _queue()
    restored.load_state_dict(state)
    assert [(j.prompt_index, j.seed) for j in restored.outstanding.values()] == \
           [(j.prompt_index, j.seed) for j in taken[2:]] + [(queue.outstanding[k].prompt_index,
                                                              queue.outstanding[k].seed)
                                                             for k in list(queue.outstanding)[3:]]
    # run both to the end of 3 epochs: the restored queue trains exactly what the original would
    def drain(q, count):
        out = []
        while len(out) < count:
            jobs = q.take(1)
            q.trained(jobs)
            out.append(jobs[0].key)
        return out

    trained_before = [j.key for j in taken[:2]]
    rest = drain(restored, 3 * 7 - 2)
    everything = trained_before + rest
    for epoch in range(3):
        assert sorted(p for e, p in everything if e == epoch) == list(range(7))
    assert len(set(everything)) == len(everything)


def test_batch_queue_restores_the_drawn_batch_whole():
    queue = _queue(size=9, batch=3)
    first, second = queue.next_batch(), queue.next_batch()  # one_step_off: batch 1 in flight at the save
    queue.trained(first)
    restored = _queue(size=9, batch=3)
    restored.load_state_dict(queue.state_dict())
    assert restored.next_batch_number() == 1
    again = restored.next_batch()
    assert [(j.prompt_index, j.batch, j.position, j.seed) for j in again] == \
           [(j.prompt_index, j.batch, j.position, j.seed) for j in second]
    assert restored.next_batch_number() == 2 and restored.next_batch()[0].batch == 2


# ---------------------------------------------------------------- the async staleness policy
def _group(queue, version):
    job = queue.take(1)[0]
    samples = [Sample(prompt_ids=job.prompt_ids, response_ids=[5], response_logprobs=[-1.0],
                      finish_reason="stop", weight_version=version, group_id=0, data=job.data)
               for _ in range(2)]
    return GroupResult(job=job, samples=samples, token_versions=[None, None], seconds=0.1,
                       teacher_rows=[None, None])


@pytest.mark.parametrize("policy", ["drop", "truncated_is"])
def test_async_batch_drops_or_flags_groups_past_the_bound(policy):
    from opkd_mcore.controller.schedules import RolloutFeed

    cfg = _cfg("controller.kind=ray", "run.schedule=async", "run.max_staleness=1",
               f"run.stale_policy={policy}", "rollout.prompts_per_step=2", "parallel.global_batch_size=4")
    queue = _queue(size=10, batch=2)
    groups = SimpleNamespace(rollouts=[object()], teachers={})
    feed = RolloutFeed(cfg, groups, queue, version=3, step=3, sampling=None)
    feed.policy.admit = lambda p: None  # nothing new starts: the groups below are all there is
    made = [_group(queue, v) for v in (1, 3, 2)]
    for g in made:
        feed.generated[g.job.key] = g
    feed.in_flight = len(made)
    work = feed.take_batch(3)
    if policy == "drop":
        assert work.groups == made[1:] and work.stale == [False, False]
        (group, reason), = work.dropped
        assert group is made[0] and reason == "stale: generated with v1, trainer at v3 (run.max_staleness 1)"
        assert queue.take(1)[0] is made[0].job  # generated again before anything new
    else:
        assert work.groups == made[:2] and work.stale == [True, False] and not work.dropped


# ---------------------------------------------------------------- samples.jsonl
def test_samples_log_audit_and_resume_truncation(tmp_path):
    samples = [Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], finish_reason="stop",
                      weight_version=0, group_id=g, data={"teacher": "math"} if g else {})
               for g in (0, 0, 1, 1)]
    assert draw_epochs({"epoch": 2, "position": 5}, 6, 3) == [2, 3, 3]
    log = SamplesLog(str(tmp_path))
    teachers = [TeacherEndpoint(name="math", data_sources=["gsm8k"]), TeacherEndpoint(name="default")]
    log.write(sample_records(0, prompt_groups([4, 5], [0, 1], samples), 1, teachers))
    log.write(sample_records(1, prompt_groups([0, 1], [1, 1], samples), 2, teachers))
    rows = read_samples(str(tmp_path))
    assert [(r["prompt_index"], r["epoch"], r["sample_index"], r["teacher"]) for r in rows[:4]] == \
           [(4, 0, 0, "default"), (4, 0, 1, "default"), (5, 1, 0, "math"), (5, 1, 1, "math")]
    assert audit(rows, n=2).ok and audit(rows, n=2).max_staleness == 2
    SamplesLog(str(tmp_path), start_step=1)  # --resume from step 1: step 1's lines go
    assert [r["step"] for r in read_samples(str(tmp_path))] == [0] * 4
    bad = audit(rows + rows[:1] + [dict(rows[0], prompt_index=9, sample_index=1)], n=2, dataset_size=6)
    assert bad.duplicates == [(0, 4, 0)] and bad.partial_groups == [(0, 9)]
    assert bad.missing == {0: [0, 1, 2, 3, 5]}  # epochs before the last must be whole


def test_hang_message_names_the_bucket():
    from opkd_mcore.controller.engine_workers import _runs
    from opkd_mcore.controller.trainer_worker import _bucket_in_flight

    sender = SimpleNamespace(buckets=[SimpleNamespace(index=i, nbytes=100) for i in range(3)])
    assert _bucket_in_flight(sender, 0) == "before bucket 0 of 3 (plan handshake)"
    assert _bucket_in_flight(sender, 200) == "bucket 1 (2 of 3 started, 200 bytes)"
    assert _runs([3, 3, 4, 4, 4]) == [[3, 2], [4, 3]] and _runs([5, 5]) is None


def test_teacher_actors_per_endpoint():
    from opkd_mcore.config.placement_rules import teacher_actor_endpoints
    from opkd_mcore.controller.placement import cpus_needed

    cfg = _cfg("controller.kind=ray", "controller.teacher_replicas=2", "teacher.teachers.0.name=math",
               "teacher.teachers.0.data_sources=[gsm8k]")
    cfg.teacher.teachers.append(type(cfg.teacher.teachers[0])(name="chat", backend="remote", url="http://a:1",
                                                              replica_urls=["http://b:1"]))
    actors = teacher_actor_endpoints(cfg)
    assert [(t.name, url) for t, url in actors] == [("math", None), ("math", None), ("chat", "http://a:1"),
                                                    ("chat", "http://b:1")]
    assert cpus_needed(cfg, 2) == 2 + 1 + 4


def test_actors_sharing_a_device_start_one_at_a_time():
    """vLLM measures free device memory while it profiles at start: on a shared device the engines
    start one per wave and the trainer ranks (one collective setup) together after them."""
    from opkd_mcore.controller.groups import start_waves
    from opkd_mcore.controller.placement import Placement, Slot

    gpu0, gpu1, own = ("pg", 0), ("pg", 1), None
    device = {"rollout 0": gpu1, "teacher a": gpu1, "teacher b": gpu1, "rollout 1": own, "trainer 0": own,
              "trainer 1": own}
    calls = lambda *names: [(n, n, None) for n in names]  # noqa: E731  (the slot stands for itself)
    names = lambda waves: [[c[0] for c in w] for w in waves]  # noqa: E731
    # disaggregated, teachers with the rollout engine: that device staged, the trainers at once
    trainers = calls("trainer 0", "trainer 1")
    waves = start_waves(calls("rollout 0", "rollout 1", "teacher a", "teacher b"), trainers, device.get)
    assert names(waves) == [["rollout 0", "rollout 1", "trainer 0", "trainer 1"],
                            ["teacher a"], ["teacher b"]]
    # colocated: every rank's device shared, so the trainer ranks start after every engine, together
    device.update({"rollout 1": gpu0, "trainer 0": gpu0, "trainer 1": gpu1})
    waves = start_waves(calls("rollout 0", "rollout 1", "teacher a"), trainers, device.get)
    assert names(waves) == [["rollout 0", "rollout 1"], ["teacher a"], ["trainer 0", "trainer 1"]]
    # on CPU nothing is shared (no device memory to measure): one wave, as before
    cpu = Placement.__new__(Placement)
    cpu.device = "cpu"
    assert cpu.shared_device(Slot(pg="pg", bundle=0, cpus=1, accelerators=0.5)) is None
    gpu = Placement.__new__(Placement)
    gpu.device = "cuda"
    shared, whole = Slot("pg", 1, 1, 0.5), Slot("pg", 1, 1, 1.0)
    assert gpu.shared_device(shared) == (id("pg"), 1) and gpu.shared_device(whole) is None


# ---------------------------------------------------------------- truncated importance weights
def _is_weights(rank, world, model_dir):
    from opkd_mcore.config import ParallelSection
    from opkd_mcore.controller.importance import truncated_is_weights
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.objective import _token_logprobs

    init_parallel(ParallelConfig(seed=3))
    try:
        engine, _ = build_student(model_dir, None)
        prompts, responses = [[1, 4, 5], [1, 6], [1, 7, 8]], [[9, 10, 11], [12, 13], [14]]
        own = []
        for p, r in zip(prompts, responses):
            batch = pack_sequences([p + r], [len(p)])
            lp = _token_logprobs(engine.forward_logits(batch), torch.roll(batch.tokens, -1))
            own.append(lp[len(p) - 1:len(p) - 1 + len(r)].tolist())
        shifts = [0.5, 0.0, 3.0]  # the sampler found the response e^shift times less likely per token
        samples = [Sample(prompt_ids=p, response_ids=r, response_logprobs=[x - d for x in lp],
                          finish_reason="stop", weight_version=0, group_id=i)
                   for i, (p, r, lp, d) in enumerate(zip(prompts, responses, own, shifts))]
        weights, metrics = truncated_is_weights(engine, samples, [True, False, True],
                                                ParallelSection(micro_batch_size=2, global_batch_size=3),
                                                shard_layout(engine), cap=2.0)
        return weights.tolist(), metrics
    finally:
        destroy_parallel()


def test_truncated_importance_weights_of_stale_samples(tmp_path):
    from opkd_mcore.models.tiny import save_tiny_hf_model
    from tests._dist import run_distributed

    model_dir = save_tiny_hf_model(str(tmp_path / "tiny"), seed=3, init_std=0.1)
    (weights, metrics), = run_distributed(_is_weights, 1, model_dir)
    assert weights == pytest.approx([math.exp(0.5), 1.0, 2.0], rel=1e-4)  # fresh: 1; e^3 capped at 2
    assert metrics["async/is_truncated_fraction"] == 0.5


# ---------------------------------------------------------------- teacher calls
class _FakeTeacher:
    """Stands in for a teacher actor handle: records the sequences of each call."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls
        self.score = self

    def options(self, num_returns):
        assert num_returns == 2  # rows and seconds travel as two objects
        return self

    def remote(self, sequences):
        self.calls.append((self.name, len(sequences)))
        return object(), object()


def test_the_groups_of_one_rollout_reply_go_to_the_teacher_together():
    """A step's prompts come back from an engine in one reply: its groups are scored in as few calls
    as the token budget allows (one here), not one call per group (the per-call cost of a vLLM
    teacher made 32 calls of 4 samples the largest stage of a two-GPU step)."""
    from opkd_mcore.controller.schedules import RolloutCall, RolloutFeed

    cfg = _cfg("controller.kind=ray", "parallel.micro_batch_size=2", "parallel.global_batch_size=8",
               "rollout.n=2", "rollout.prompts_per_step=4")
    calls = []
    feed = RolloutFeed(cfg, SimpleNamespace(rollouts=[object()], teachers={cfg.teacher.teachers[0].name: [_FakeTeacher("t0", calls)]}),
                       _queue(size=10, batch=4), version=0, step=0, sampling=None)
    jobs = feed.queue.take(4)
    groups = [_group(_queue(size=10, batch=4), 0) for _ in jobs]  # 2 samples each
    reply = SimpleNamespace(seconds=1.0, samples=[g.samples for g in groups], token_versions=[[None] * 2] * 4)
    feed.ray = SimpleNamespace(get=lambda ref: reply)
    ref = object()
    feed.rollout_calls[ref] = RolloutCall(0, jobs)
    feed.busy[0] = 1
    feed._on_generated(ref)
    assert calls == [("t0", 8)]
    assert all(feed.generated[j.key].pending_teacher_calls == 1 for j in jobs)


def test_samples_go_to_their_teacher_in_token_budget_calls_on_the_least_loaded_replica():
    from opkd_mcore.controller.schedules import RolloutFeed

    cfg = _cfg("controller.kind=ray", "teacher.teachers.0.name=math",
               "teacher.teachers.0.data_sources=[gsm8k]",
               "parallel.micro_batch_size=3", "parallel.global_batch_size=6", "rollout.n=2",
               "rollout.prompts_per_step=3")
    cfg.teacher.teachers.append(type(cfg.teacher.teachers[0])(name="chat", backend="remote", url="http://a:1"))
    calls = []
    teachers = {"math": [_FakeTeacher("math0", calls), _FakeTeacher("math1", calls)],
                "chat": [_FakeTeacher("chat0", calls)]}
    queue = _queue(size=10, batch=4)
    groups = [_group(queue, 0) for _ in range(4)]
    lengths = {len(s.teacher_sequence) for g in groups for s in g.samples}
    assert len(lengths) == 1  # samples of equal length: the budget below holds 3 of them (3.5 do not fit)
    cfg.controller.teacher_call_tokens = int(3.5 * lengths.pop())
    feed = RolloutFeed(cfg, SimpleNamespace(rollouts=[object()], teachers=teachers), queue,
                       version=0, step=0, sampling=None)
    for g, routed in zip(groups, ["math", None, "math", None]):  # route_data's "teacher" key, or the default
        if routed:
            g.job.data["teacher"] = routed
    feed._score(groups)
    # math: 4 samples over its two replicas -> 2 + 2 (its budget: half its tokens); chat (the default,
    # one replica): the 3.5-sample budget -> 3 + 1
    assert calls == [("math0", 2), ("math1", 2), ("chat0", 3), ("chat0", 1)]
    rows = {g.job.prompt_index: g.teacher_rows for g in groups}
    assert rows[groups[0].job.prompt_index] == [(0, 0), (0, 1)]
    assert rows[groups[2].job.prompt_index] == [(1, 0), (1, 1)]
    assert rows[groups[3].job.prompt_index] == [(2, 2), (3, 0)]  # a group split over two teacher calls
    assert [g.pending_teacher_calls for g in groups] == [1, 1, 1, 2]
    assert not any(feed.scored(g) for g in groups)
