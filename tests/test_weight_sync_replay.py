"""Replaying recorded bucket loads (`weight_sync.copy_replay`) against running the loaders each time.

The stand-in engine model loads like vLLM's weight loaders: q_proj lands in the first rows of a fused
qkv tensor (narrow + copy_), the embedding in a vocabulary-padded tensor whose padding is zero-filled,
norms by a plain copy_. The reference is the same model loaded by those loaders from the same bytes.
The senders are real processes over gloo (`tests/test_weight_sync_transport.py`'s two-stage plan).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import weakref

import pytest
import torch

from opkd_mcore.weight_sync import copy_replay
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from opkd_mcore.weight_sync.copy_replay import BucketReplay, CopyRecorder, ModelStorages, model_storages
from opkd_mcore.weight_sync.megatron_source import SyncGroupsConfig
from tests._dist import free_port
from tests.test_weight_sync_transport import BUCKET_BYTES, _collect, _sender_proc, _stage_tensors, _start

PAD_ROWS = 20  # the engine's embedding has more rows than the checkpoint's (vLLM pads the vocabulary)


class StandInEngineModel(torch.nn.Module):
    """The tensors of `_stage_tensors(0, v)` held the way an inference engine holds them."""

    def __init__(self):
        super().__init__()
        shapes = dict((n, t.shape) for n, t in _stage_tensors(0, 0))
        emb = shapes["model.embed_tokens.weight"]
        self.embed = torch.nn.Parameter(torch.full((emb[0] + PAD_ROWS, emb[1]), 7.0), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for layer in range(3):
            q = shapes[f"model.layers.{layer}.self_attn.q_proj.weight"]
            m = torch.nn.Module()
            m.qkv = torch.nn.Parameter(torch.full((q[0] + 16, q[1]), 5.0), requires_grad=False)
            m.down = torch.nn.Parameter(torch.zeros(shapes[f"model.layers.{layer}.mlp.down_proj.weight"],
                                                    dtype=torch.bfloat16), requires_grad=False)
            m.norm = torch.nn.Parameter(torch.zeros(shapes[f"model.layers.{layer}.input_layernorm.weight"]),
                                        requires_grad=False)
            self.layers.append(m)

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "model.embed_tokens.weight":
                self.embed.data[:w.shape[0]].copy_(w)
                self.embed.data[w.shape[0]:].fill_(0)
                continue
            m = self.layers[int(name.split(".")[2])]
            if "q_proj" in name:
                m.qkv.data.narrow(0, 0, w.shape[0]).copy_(w)
            elif "down_proj" in name:
                m.down.data.copy_(w)
            else:
                m.norm.data.copy_(w)


def _state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _receiver_proc(groups, versions, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        model, reference = StandInEngineModel(), StandInEngineModel()
        calls = {"loader": 0}

        def load(named):
            calls["loader"] += 1
            model.load_weights(named)

        receiver, replay = BucketReceiver(), BucketReplay(model_storages(model))
        receiver.join(groups[:1], 1)
        per_sync = []
        for v in versions:
            calls["loader"] = 0
            assert receiver.receive(load, replay) == v
            reference.load_weights(_stage_tensors(0, v))
            equal = all(torch.equal(a, b) for a, b in zip(_state(model).values(), _state(reference).values()))
            per_sync.append((equal, calls["loader"], receiver.stats.last_replayed))
        pure = sum(r.impure is None for r in replay.records.values())
        queue.put(("receiver", 1, (per_sync, len(receiver.plan.stage_buckets(0)), pure)))
        receiver.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def _lazy_replay_receiver_proc(groups, versions, queue):
    """The replay handed over as a function (as the vLLM worker does): per sync, the order of the
    posted transfers and that function's calls, and whether the model equals the reference."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        model, reference = StandInEngineModel(), StandInEngineModel()
        receiver, replay = BucketReceiver(), BucketReplay(model_storages(model))
        receiver.join(groups[:1], 1)
        events, post = [], receiver._post  # a bucket's receive (the header's moves are not posted)
        receiver._post = lambda *a: events.append("post") or post(*a)
        per_sync = []
        for v in versions:
            events.clear()
            assert receiver.receive(model.load_weights, lambda: events.append("replay") or replay) == v
            reference.load_weights(_stage_tensors(0, v))
            equal = all(torch.equal(a, b) for a, b in zip(_state(model).values(), _state(reference).values()))
            per_sync.append((equal, list(events), receiver.stats.last_replayed))
        queue.put(("receiver", 1, per_sync))
        receiver.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def _split_receiver_proc(groups, versions, queue, loads_in_place):
    """Buckets that split a layer's tensors, loaded in place or not: per sync, whether the model
    equals the reference and how many buckets were replayed; then which buckets split a group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        model, reference = StandInEngineModel(), StandInEngineModel()
        receiver, replay = BucketReceiver(), BucketReplay(model_storages(model))
        receiver.join(groups[:1], 1)
        per_sync = []
        for v in versions:
            assert receiver.receive(model.load_weights, replay, loads_in_place=loads_in_place) == v
            reference.load_weights(_stage_tensors(0, v))
            equal = all(torch.equal(a, b) for a, b in zip(_state(model).values(), _state(reference).values()))
            per_sync.append((equal, receiver.stats.last_replayed))
        split = [b.splits_group for b in receiver.plan.stage_buckets(0)]
        queue.put(("receiver", 1, (per_sync, split)))
        receiver.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def _staging_receiver_proc(groups, versions, queue):
    """A colocated receiver whose engine device is not the lent buffers' (an EP rank's beside the
    engine's GPU, by device IPC): on CPU, "cpu:0" stands in for that other device. Per sync: whether
    the model equals the reference, buckets staged, buckets replayed, the staging buffer's address."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from opkd_mcore.weight_sync import bucket_receiver

        bucket_receiver.current_device = lambda device=None: torch.device("cpu", 0)
        model, reference = StandInEngineModel(), StandInEngineModel()
        receiver, replay = BucketReceiver(), BucketReplay(model_storages(model))
        receiver.join(groups[:1], 1, transport="colocated_ipc")
        per_sync = []
        for v in versions:
            assert receiver.receive(model.load_weights, replay, loads_in_place=True) == v
            reference.load_weights(_stage_tensors(0, v))
            equal = all(torch.equal(a, b) for a, b in zip(_state(model).values(), _state(reference).values()))
            per_sync.append((equal, receiver.stats.last_staged, receiver.stats.last_replayed,
                             receiver._staging.data_ptr()))
        queue.put(("receiver", 1, (per_sync, len(receiver.plan.stage_buckets(0)))))
        receiver.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def _sync_four_versions(receiver_target, *receiver_args, bucket_bytes=BUCKET_BYTES, transport="group"):
    """Stage 0 of the two-stage plan sent as versions 3..6 by a real sender process (over `transport`)
    to a receiver process running `receiver_target(groups, versions, queue, *receiver_args)`; returns
    what the receiver reported."""
    queue = mp.get_context("spawn").Queue()
    groups = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=60).stage_groups(2)
    versions = [3, 4, 5, 6]
    procs = [_start(_sender_proc, 0, groups[0], versions, queue, transport, bucket_bytes),
             _start(receiver_target, groups, versions, queue, *receiver_args)]
    results = _collect(queue, 2, timeout=120)
    for p in procs:
        p.join(30)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[0][2]
    (payload,) = [r[2] for r in results if r[0] == "receiver"]
    return payload


def test_replayed_syncs_equal_the_loaders_bitwise():
    per_sync, num_buckets, pure = _sync_four_versions(_receiver_proc)
    assert num_buckets > 2 and pure == num_buckets  # views, narrow + copy_ and fill_ only: all pure
    assert all(equal for equal, _, _ in per_sync)
    first, *later = per_sync
    # bucket i always arrives in receive buffer i % 2: each is recorded once, on the first sync
    assert first == (True, num_buckets, 0)
    assert later == [(True, 0, num_buckets)] * len(later)


def test_buckets_lent_from_another_device_are_staged_once_and_replayed_from_the_staging_buffer():
    per_sync, num_buckets = _sync_four_versions(_staging_receiver_proc, transport="colocated_ipc")
    assert num_buckets > 2
    assert all(equal for equal, *_ in per_sync)
    assert [staged for _, staged, _, _ in per_sync] == [num_buckets] * len(per_sync)
    # recorded on the first sync (keyed by the staging buffer), replayed from then on
    assert [replayed for _, _, replayed, _ in per_sync] == [0] + [num_buckets] * (len(per_sync) - 1)
    assert len({ptr for *_, ptr in per_sync}) == 1  # one staging buffer, allocated once


def _bucket_of(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


def _via_temporary(p, w):
    tmp = torch.empty(w.shape)
    tmp.copy_(w)
    p.copy_(tmp)


@pytest.mark.parametrize("loader, why", [
    (lambda p, w: p.copy_(w.double()), "_to_copy"),                     # a cast: other bytes
    (lambda p, w: p.copy_(w[:1]), "converting copy"),                   # a broadcasting copy
    (lambda p, w: p.index_put_((torch.tensor([0]),), w[:1]), "index_put"),
    (lambda p, w: p.copy_(w.clone()), "clone"),
    (_via_temporary, "not source -> target"),
    (lambda p, w: p.copy_(w * 2), "mul"),
])
def test_a_load_that_is_not_a_pure_copy_is_never_replayed(loader, why):
    param = torch.zeros(4, 3)
    buf = _bucket_of(torch.arange(12, dtype=torch.float32).view(4, 3))
    with CopyRecorder(model_storages_of(buf), model_storages_of(param)) as rec:
        loader(param, buf.view(torch.float32).view(4, 3))
    assert rec.record.impure is not None and why in rec.record.impure
    with pytest.raises(RuntimeError, match="not replayable"):
        rec.record.replay()


def test_bucket_replay_runs_the_loader_for_impure_buckets_every_time():
    param = torch.zeros(4, 3)
    buf = _bucket_of(torch.ones(4, 3))
    replay, calls = BucketReplay(model_storages_of(param)), []

    def load(named):
        calls.append(1)
        param.copy_(named[0][1] + 1)

    views = lambda: [("w", buf.view(torch.float32).view(4, 3))]  # noqa: E731
    assert [replay.run(("d", 0, 0), buf, lambda: load(views())) for _ in range(3)] == [False, False, False]
    assert len(calls) == 3 and torch.equal(param, torch.full((4, 3), 2.0))


def test_replay_follows_new_bucket_bytes_and_leaves_other_rows():
    param = torch.full((6, 2), 9.0)
    buf = _bucket_of(torch.zeros(4, 2))
    with CopyRecorder(model_storages_of(buf), model_storages_of(param)) as rec:
        param.narrow(0, 1, 4).copy_(buf.view(torch.float32).view(4, 2))
    new = torch.arange(8, dtype=torch.float32).view(4, 2)
    buf.copy_(_bucket_of(new))
    rec.record.replay()
    assert torch.equal(param[1:5], new) and torch.equal(param[[0, 5]], torch.full((2, 2), 9.0))


def model_storages_of(*tensors: torch.Tensor) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def change_weights(params: list[torch.Tensor], v: int, move: bool) -> None:
    """Every parameter changed in place (by an amount depending on `v`); `move`: the first one
    also gets new storage, as a checkpoint load may give it."""
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_(0.01 * v * (i + 1))
        if move:
            params[0].data = params[0].data.clone() + 1


def _megatron_sender(rank, world, hf_dir, sync_cfg, tp):
    """Change the weights in place, sync, and keep the export's digests (the reference), four times;
    before the fourth sync one parameter gets new storage, as a checkpoint load may do."""
    from opkd_mcore.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport

    init_parallel(ParallelConfig(tp=tp, seed=3))
    try:
        chunks = build_model(load_hf_config(hf_dir), params_dtype=torch.float32)
        load_hf_weights(chunks, hf_dir)
        sync = MegatronWeightExport(chunks, SyncGroupsConfig(**sync_cfg))
        sync.connect()
        params = [p for p in chunks[0].parameters()]
        out = []
        for v in (1, 2, 3, 4):
            change_weights(params, v, move=v == 4)
            reference = {n: _digest(t) for n, t in iter_hf_weights(chunks, stages="local")}
            sync.sync(v)
            out.append((reference, sync.sender.stats.last_replayed if sync.sender else None))
        sync.close()
        return {"owner": sync.sender is not None, "syncs": out,
                "buckets": len(sync.plan.buckets)}
    finally:
        destroy_parallel()


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_sender_replays_its_packs_only_where_the_export_is_local(tmp_path, tp):
    """TP=1: from the second sync on the sender replays its packs without walking the export, and the
    receiver gets the export's bytes every time (q/k/v of grouped-query attention included); a
    parameter whose storage moved is recorded anew. TP=2: the export gathers, nothing is replayed."""
    from dataclasses import asdict

    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
    from tests._dist import run_distributed
    from tests.test_weight_sync_transport import _receiver_proc as digest_receiver

    hf_dir = save_tiny_hf_model(str(tmp_path / "tiny"), "qwen3", TinyModelShape(num_key_value_heads=2))
    cfg = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=120, bucket_bytes=64 * 1024)
    queue = mp.get_context("spawn").Queue()
    receiver = _start(digest_receiver, 1, cfg.stage_groups(1), 4, 10**6, queue)
    per_rank = run_distributed(_megatron_sender, max(tp, 1), hf_dir, asdict(cfg), tp)
    kind, _, payload = queue.get(timeout=120)
    receiver.join(30)
    assert kind == "receiver", payload
    versions, loaded = payload[0], payload[1]
    (owner,) = [r for r in per_rank if r["owner"]]
    assert versions == [1, 2, 3, 4] and owner["buckets"] > 2
    for (reference, _), received in zip(owner["syncs"], loaded):
        assert received == reference
    replayed = [n for _, n in owner["syncs"]]
    assert replayed == ([0, owner["buckets"], owner["buckets"], 0] if tp == 1 else [0, 0, 0, 0])



def test_a_new_plan_drops_the_old_plans_records():
    param = torch.zeros(4, 3)
    old_buf, new_buf = _bucket_of(torch.ones(4, 3)), _bucket_of(torch.full((4, 3), 2.0))
    replay = BucketReplay(model_storages_of(param))

    def load_from(buf):
        return lambda named: param.copy_(named[0][1])

    for digest, buf in (("plan-a", old_buf), ("plan-a", old_buf), ("plan-b", new_buf)):
        views = lambda buf=buf: [("w", buf.view(torch.float32).view(4, 3))]  # noqa: E731
        replay.run((digest, 0, buf.data_ptr()), buf, lambda: load_from(buf)(views()))
    assert list(replay.records) == [("plan-b", 0, new_buf.data_ptr())]
    assert torch.equal(param, torch.full((4, 3), 2.0))


def test_replay_keeps_the_order_of_fills_and_copies():
    """A loader that clears a tensor and then copies into part of it: replayed in that order."""
    param = torch.full((4, 3), 9.0)
    buf = _bucket_of(torch.zeros(2, 3))
    with CopyRecorder(model_storages_of(buf), model_storages_of(param)) as rec:
        param.zero_()
        param[1:3].copy_(buf.view(torch.float32).view(2, 3))
    assert rec.record.impure is None and [s[0] for s in rec.record.steps] == ["fill", "copy"]
    new = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    buf.copy_(_bucket_of(new))
    param.fill_(9.0)
    rec.record.replay()
    assert torch.equal(param, torch.cat([torch.zeros(1, 3), new, torch.zeros(1, 3)]))


def test_copies_that_may_write_the_same_bytes_are_never_replayed():
    """A run of copies is replayed as one batch in no set order: overlapping writes stay unreplayed."""
    param = torch.zeros(4, 3)
    buf = _bucket_of(torch.ones(3, 3))
    replay = BucketReplay(model_storages_of(param))
    rows = buf.view(torch.float32).view(3, 3)

    def load(named):
        param[0:2].copy_(rows[0:2])
        param[1:3].copy_(rows[1:3])  # rows 1 written twice

    assert not replay.run(("d", 0, 0), buf, lambda: load(None))
    assert "overlapping" in replay.records[("d", 0, 0)].impure
    assert not replay.run(("d", 0, 0), buf, lambda: load(None))  # the loader again, never a replay


def _direct_worker_proc(groups, versions, queue):
    """The vLLM worker extension's direct-mode receive (`VllmWeightReceiver.opkd_receive_weights`)
    on a stand-in worker: only the engine model is a stand-in (a CPU vLLM engine repacks its
    weights, so it loads layerwise and never takes this branch). Before the third sync one tensor
    is reallocated, as a reload may do: its records must not be replayed."""
    from types import SimpleNamespace

    from opkd_mcore.weight_sync.receiver import VllmWeightReceiver

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        worker = VllmWeightReceiver()
        worker.model_runner = SimpleNamespace(model=StandInEngineModel())
        worker._opkd_mode = "direct"
        worker._opkd_receiver, worker._opkd_replay = BucketReceiver(), None
        worker._opkd_receiver.join(groups[:1], 1)
        reference, out = StandInEngineModel(), []
        for v in versions:
            if v == versions[2]:
                worker.model_runner.model.embed.data = worker.model_runner.model.embed.data.clone()
            assert worker.opkd_receive_weights() == v
            reference.load_weights(_stage_tensors(0, v))
            equal = all(torch.equal(a, b) for a, b in zip(_state(worker.model_runner.model).values(),
                                                          _state(reference).values()))
            stats = worker.opkd_weight_sync_stats()
            out.append((equal, stats["last_replayed"], stats["weights_consistent"]))
        queue.put(("receiver", 1, out))
        worker.opkd_close_weight_sync()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def test_vllm_receiver_direct_mode_replays_and_rerecords_moved_tensors():
    per_sync = _sync_four_versions(_direct_worker_proc)
    assert all(equal and consistent for equal, _, consistent in per_sync)
    replayed = [n for _, n, _ in per_sync]
    assert replayed[0] == 0 and replayed[1] > 0 and replayed[2] == 0 and replayed[3] == replayed[1]


def test_a_replay_made_on_demand_is_made_once_after_the_first_receive_is_posted():
    """Its host work (the worker's check that the engine's tensors stayed put) overlaps bucket 0's
    transfer instead of delaying it."""
    per_sync = _sync_four_versions(_lazy_replay_receiver_proc)
    assert all(equal for equal, _, _ in per_sync)
    for _, events, _ in per_sync:
        assert events[:2] == ["post", "replay"] and events.count("replay") == 1 and len(events) > 2
    assert per_sync[0][2] == 0 and all(replayed > 0 for _, _, replayed in per_sync[1:])


@pytest.mark.parametrize("loads_in_place", [True, False])
def test_buckets_that_split_a_layer_are_replayed_when_the_load_is_in_place(loads_in_place):
    """A layer larger than a bucket spans buckets. A load that keeps the bucket's tensors past its
    return (vLLM's layerwise reload) gets copies of a split layer's, so those buckets are never
    replayed; an in-place load (vLLM's direct load) gets views, and every bucket is replayed.
    Either way the model equals the reference loaded from the same bytes."""
    per_sync, split = _sync_four_versions(_split_receiver_proc, loads_in_place, bucket_bytes=4096)
    assert sum(split) >= 3 and not all(split)
    assert all(equal for equal, _ in per_sync)
    expected = len(split) if loads_in_place else len(split) - sum(split)
    assert [n for _, n in per_sync] == [0, expected, expected, expected]


def _small_model() -> torch.nn.Sequential:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))
    model[0].register_buffer("scale", torch.ones(4))
    model[2].register_buffer("empty", torch.zeros(0))
    return model


def test_model_storages_of_an_unchanged_model_are_walked_once():
    model = _small_model()
    storages = ModelStorages(model)
    first = storages.current()
    for _ in range(5):
        assert storages.current() == first
    assert storages.walks == 1
    assert first == model_storages(model) == \
        {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel() > 0}


def _weight() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(4, 3))


MODEL_CHANGES = {  # `spare`: a Linear built before the first walk, so its tensors registered before it
    "attribute": lambda m, spare: setattr(m[0], "weight", _weight()),
    "register_parameter": lambda m, spare: m[0].register_parameter("weight", _weight()),
    "new_parameter": lambda m, spare: m[2].register_parameter("extra", _weight()),
    "register_buffer": lambda m, spare: m[0].register_buffer("scale", torch.zeros(4)),
    "buffer_assigned": lambda m, spare: setattr(m[0], "scale", torch.zeros(4)),
    "data": lambda m, spare: setattr(m[0].weight, "data", torch.empty_like(m[0].weight)),
    "empty_buffer_grows": lambda m, spare: m[2].empty.resize_(8),
    "submodule_attached": lambda m, spare: m.__setitem__(0, spare),
}


@pytest.mark.parametrize("change", list(MODEL_CHANGES))
def test_model_storages_are_walked_again_after_a_change(change):
    model, spare = _small_model(), torch.nn.Linear(3, 4)
    storages = ModelStorages(model)
    before = set(storages.current())
    MODEL_CHANGES[change](model, spare)
    assert storages.current() == model_storages(model) != before
    assert storages.walks == 2
    assert storages.current() == model_storages(model) and storages.walks == 2


@pytest.mark.parametrize("view_kept", [False, True])
def test_model_storages_see_a_parameter_written_straight_into_the_dict(view_kept):
    """`module._parameters[name] = ...` fires no registration hook. Unreferenced, the old parameter
    dies (the watch list holds it weakly); kept alive by a view (as the replay records hold views
    of the model's tensors), it is no longer the one in the dict. Either way: walked again."""
    model = _small_model()
    storages = ModelStorages(model)
    before = set(storages.current())
    old = weakref.ref(model[0].weight)
    view = model[0].weight[1:3] if view_kept else None
    registrations = copy_replay._registrations
    model[0]._parameters["weight"] = torch.nn.Parameter(torch.randn(4, 3))
    assert (old() is None) != view_kept
    assert copy_replay._registrations == registrations  # only the watch list can have seen it
    assert storages.current() == model_storages(model) != before
    assert storages.walks == 2
    del view

