"""Sender, transports and the engine-free receiver in real processes over gloo.

Stand-in receivers (`BucketReceiver`, the same code the vLLM extension runs) let these tests use
several receivers, two PP stage senders and a receiver that dies mid-sync, none of which needs an
inference engine.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import time
import traceback

import pytest
import torch

from opkd_mcore.weight_sync import (
    BucketPlan,
    BucketSender,
    TransportConfig,
    WeightSyncTimeout,
    make_transport,
)
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from opkd_mcore.weight_sync.megatron_source import SyncGroupsConfig
from tests._dist import free_port

BUCKET_BYTES = 8192


def _stage_tensors(stage: int, version: int) -> list[tuple[str, torch.Tensor]]:
    """A two-stage 'model' whose values depend on the version (float32, bfloat16 and int tensors)."""
    g = torch.Generator().manual_seed(100 * stage + version)
    out = []
    for layer in range(3 * stage, 3 * stage + 3):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", torch.randn(24, 32, generator=g)),
                (p + "mlp.down_proj.weight", torch.randn(32, 40, generator=g).to(torch.bfloat16)),
                (p + "input_layernorm.weight", torch.randn(32, generator=g))]
    if stage == 0:
        out.insert(0, ("model.embed_tokens.weight", torch.randn(300, 32, generator=g)))  # > 1 bucket
    else:
        out.append(("lm_head.weight", torch.randn(50, 32, generator=g)))
        out.append(("model.extra_ids", torch.arange(7, dtype=torch.int64) * version))
    return out


def _plan(bucket_bytes: int = BUCKET_BYTES) -> BucketPlan:
    from opkd_mcore.models import WeightMeta

    meta = [WeightMeta(n, tuple(t.shape), t.dtype, stage) for stage in (0, 1) for n, t in _stage_tensors(stage, 0)]
    return BucketPlan.from_metadata(meta, bucket_bytes)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sender_proc(stage, group, versions, queue, transport_name="group", bucket_bytes=BUCKET_BYTES):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        transport = make_transport(transport_name, group, rank=0)
        sender = BucketSender(_plan(bucket_bytes), transport, stage)
        for v in versions:
            sender.sync(iter(_stage_tensors(stage, v)), v)
        s = sender.stats
        queue.put(("sender", stage, (s.handshakes, s.buffer_allocations, s.syncs)))
        transport.close()
    except BaseException:
        queue.put(("error", stage, traceback.format_exc()))


def _forbid_unpickling() -> None:
    """Make every unpickling entry point (and torch's IPC rebuild functions it would call) raise."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions as reductions

    def refuse(*args, **kwargs):
        raise AssertionError("the receive path unpickled bytes from the control group")

    pickle.loads = pickle.load = pickle.Unpickler = ForkingPickler.loads = refuse
    reductions.rebuild_storage_filename = reductions.rebuild_cuda_tensor = refuse


def _receiver_proc(rank, groups, num_syncs, die_after_buckets, queue, transport_name="group",
                   forbid_unpickling=False):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        if forbid_unpickling:
            _forbid_unpickling()
        receiver = BucketReceiver()
        receiver.join(groups, rank, transport=transport_name)
        loaded: list[dict] = []
        counter = {"buckets": 0, "in_place": 0}

        def load(named):
            counter["buckets"] += 1
            if counter["buckets"] > die_after_buckets:
                os._exit(17)  # dies mid-sync, without a goodbye
            held = {b.untyped_storage().data_ptr() for b in receiver.buffers()}
            counter["in_place"] += all(t.untyped_storage().data_ptr() in held for _, t in named)
            loaded[-1].update({n: _digest(t) for n, t in named})

        versions = []
        for _ in range(num_syncs):
            loaded.append({})
            versions.append(receiver.receive(load))
        s = receiver.stats
        if transport_name == "colocated_ipc":  # views of the sender's buffers, which it names
            assert counter["in_place"] == counter["buckets"], counter
        queue.put(("receiver", rank, (versions, loaded, s.plan_parses, s.buffer_allocations, s.buffer_ptrs)))
        receiver.close()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


def _start(target, *args):
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    return proc


def _collect(queue, n, timeout):
    out = []
    for _ in range(n):
        out.append(queue.get(timeout=timeout))
    return out


def test_two_stages_two_receivers_bitwise_and_reuse():
    queue = mp.get_context("spawn").Queue()
    groups = SyncGroupsConfig(base_port=free_port(8), num_receivers=2, timeout_s=60).stage_groups(2)
    assert [g.port for g in groups] == [groups[0].port, groups[0].port + 1]
    versions = [3, 4]
    procs = [_start(_sender_proc, s, groups[s], versions, queue) for s in (0, 1)]
    procs += [_start(_receiver_proc, r, groups, len(versions), 10**6, queue) for r in (1, 2)]
    results = _collect(queue, 4, timeout=120)
    for p in procs:
        p.join(30)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[0][2]
    senders = {r[1]: r[2] for r in results if r[0] == "sender"}
    assert senders == {0: (1, 2, 2), 1: (1, 2, 2)}  # one handshake, two buffers, two syncs each
    for _, rank, (got_versions, loaded, plan_parses, allocations, ptrs) in [r for r in results if r[0] == "receiver"]:
        assert got_versions == versions
        assert plan_parses == 1 and allocations == 2 and len(set(ptrs)) == 2
        for v, received in zip(versions, loaded):
            expected = {n: _digest(t) for s in (0, 1) for n, t in _stage_tensors(s, v)}
            assert received == expected, f"receiver {rank} version {v}"


def test_colocated_ipc_transport_over_shared_memory():
    """The colocated path with CPU shared memory standing in for device IPC handles. The receiver
    reads the sender's buffers in place (every loaded view is in a buffer it names) and allocates
    none of its own."""
    queue = mp.get_context("spawn").Queue()
    group = TransportConfig(port=free_port(), world_size=2, timeout_s=60)
    versions = [1, 2]
    procs = [_start(_sender_proc, 0, group, versions, queue, "colocated_ipc"),
             _start(_receiver_proc, 1, [group], len(versions), 10**6, queue, "colocated_ipc")]
    results = {r[0]: r for r in _collect(queue, 2, timeout=120)}
    for p in procs:
        p.join(30)
    assert "error" not in results, results["error"][2]
    assert results["sender"][2] == (1, 2, 2)
    got_versions, loaded, plan_parses, allocations, _ = results["receiver"][2]
    assert got_versions == versions and plan_parses == 1 and allocations == 0
    for v, received in zip(versions, loaded):
        assert received == {n: _digest(t) for n, t in _stage_tensors(0, v)}


def test_colocated_ipc_receivers_never_unpickle_and_stay_bitwise():
    """Two receivers in processes where unpickling raises: handles travel as plain fields."""
    queue = mp.get_context("spawn").Queue()
    group = TransportConfig(port=free_port(), world_size=3, timeout_s=60)
    versions = [1, 2]
    procs = [_start(_sender_proc, 0, group, versions, queue, "colocated_ipc")]
    procs += [_start(_receiver_proc, r, [group], len(versions), 10**6, queue, "colocated_ipc", True)
              for r in (1, 2)]
    results = _collect(queue, 3, timeout=120)
    for p in procs:
        p.join(30)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[0][2]
    receivers = [r for r in results if r[0] == "receiver"]
    assert len(receivers) == 2
    for _, rank, (got_versions, loaded, _, allocations, _) in receivers:
        assert got_versions == versions and allocations == 0  # both read the sender's buffers in place
        for v, received in zip(versions, loaded):
            assert received == {n: _digest(t) for n, t in _stage_tensors(0, v)}, f"receiver {rank} v{v}"


def _handle_message(buf_id: int, nbytes: int, corrupt) -> list[torch.Tensor]:
    """The control messages a sender would broadcast for a fresh buffer, after `corrupt(words, raw)`."""
    from opkd_mcore.platform.ipc_handles import encode_handles, export_ipc_handles, share_buffer

    words, raw = encode_handles(export_ipc_handles(share_buffer(64, torch.device("cpu")), 1))
    words, raw = corrupt(words.clone(), raw.clone())
    return [torch.tensor([buf_id, nbytes, words.numel(), raw.numel()]), words, raw]


def _bytes(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _set(t: torch.Tensor, i: int, v: int) -> torch.Tensor:
    t[i] = v
    return t


@pytest.mark.parametrize("corrupt, match", [
    (lambda w, r: (_set(w, 0, 1000), r), r"expected 1\.\.64 handles"),
    (lambda w, r: (_set(w, 1, 9), r), "handle 0 has kind 9"),
    (lambda w, r: (w[:-1], r), "cut short"),
    (lambda w, r: (w, r[:-3]), "bytes of strings"),
    (lambda w, r: (torch.cat([w, torch.tensor([5])]), r), "left over"),
    (lambda w, r: (_set(w, 4, 65), r), r"do not fit the shared storage of 64 bytes"),
    (lambda w, r: (w, torch.cat([r[:-int(w[-1])], _bytes(b"/a/b".ljust(int(w[-1]), b"x"))])),
     "not of the form /NAME"),
    (lambda w, r: (w, _set(r, 0, 0xFF)), "expected printable ASCII"),
])
def test_colocated_ipc_rejects_inconsistent_handle_naming_the_buffer(corrupt, match):
    from opkd_mcore.platform.ipc_handles import IpcHandleError
    from opkd_mcore.weight_sync.colocated_ipc import ColocatedIpcTransport

    transport = ColocatedIpcTransport(TransportConfig(port=4242, world_size=2), rank=1)
    messages = iter(_handle_message(7, 32, corrupt))
    transport._control_bcast = lambda t: t.copy_(next(messages))  # stands in for the sender
    with pytest.raises(IpcHandleError, match=rf"colocated buffer 7 on 127.0.0.1:4242.*{match}"):
        transport.broadcast(torch.empty(64, dtype=torch.uint8), 32).wait(1)


def test_colocated_ipc_unknown_buffer_without_handle_is_refused():
    from opkd_mcore.platform.ipc_handles import IpcHandleError
    from opkd_mcore.weight_sync.colocated_ipc import ColocatedIpcTransport

    transport = ColocatedIpcTransport(TransportConfig(port=4242, world_size=2), rank=1)
    transport._control_bcast = lambda t: t.copy_(torch.tensor([3, 16, 0, 0]))
    with pytest.raises(IpcHandleError, match="colocated buffer 3 .*never sent this buffer's handle"):
        transport.broadcast(torch.empty(16, dtype=torch.uint8), 16).wait(1)


def test_dead_receiver_fails_sender_within_timeout():
    timeout_s = 20.0
    port = free_port()
    group = TransportConfig(port=port, world_size=2, timeout_s=timeout_s, join_timeout_s=300)
    queue = mp.get_context("spawn").Queue()
    receiver = _start(_receiver_proc, 1, [group], 1, 1, queue)  # dies after its first bucket
    plan = BucketPlan.from_named_tensors(_stage_tensors(0, 0), BUCKET_BYTES)
    assert len(plan.buckets) > 3
    source = _stage_tensors(0, 5)
    before = {n: t.clone() for n, t in source}
    transport = make_transport("group", group, rank=0)
    sender = BucketSender(plan, transport, 0)
    transport.connect()
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="did not finish within|left the group"):
        sender.sync(iter(source), 5)
    elapsed = time.monotonic() - start
    receiver.join(30)
    assert receiver.exitcode == 17
    assert elapsed < timeout_s + 5, elapsed  # the transfer timeout at most, not a hang
    assert all(torch.equal(t, before[n]) for n, t in source)  # the trainer keeps its weights
    transport.close()


def test_join_without_peer_times_out_with_clear_error():
    group = TransportConfig(port=free_port(), world_size=2, timeout_s=3)
    receiver = BucketReceiver()
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=f"127.0.0.1:{group.port}.*could not join within 3 s"):
        receiver.join([group], rank=1)
    assert time.monotonic() - start < 30


def test_stream_errors_name_the_tensor():
    plan = BucketPlan.from_named_tensors(_stage_tensors(0, 0), BUCKET_BYTES)
    group = TransportConfig(port=free_port(), world_size=1, timeout_s=10)  # no receivers needed
    sender = BucketSender(plan, make_transport("group", group, rank=0), 0)
    wrong_dtype = [(n, t.double()) if "q_proj" in n else (n, t) for n, t in _stage_tensors(0, 1)]
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.weight' has shape"):
        sender.sync(iter(wrong_dtype), 1)
    with pytest.raises(ValueError, match="'model.bogus' is not in the plan"):
        sender.sync(iter([("model.bogus", torch.zeros(1))] + _stage_tensors(0, 1)), 1)
    with pytest.raises(ValueError, match="stream ended before tensor"):
        sender.sync(iter(_stage_tensors(0, 1)[:-2]), 1)
    with pytest.raises(ValueError, match="version"):
        sender.sync(iter(_stage_tensors(0, 1)), -1)
    # same elements, a shape that does not refine the plan's (the row-major order would differ)
    transposed = [(n, t.t()) if "q_proj" in n else (n, t) for n, t in _stage_tensors(0, 1)]
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.weight' has shape"):
        sender.sync(iter(transposed), 1)
    sender.transport.close()


@pytest.mark.parametrize("shape,target,ok", [
    ((6, 4), (6, 4), True), ((2, 3, 4), (6, 4), True), ((6, 2, 2), (6, 4), True), ((1, 6, 4), (6, 4), True),
    ((3, 8), (6, 4), False), ((4, 6), (6, 4), False), ((24,), (6, 4), False), ((2, 3), (6,), True),
    ((5,), (6,), False)])
def test_a_view_shape_must_refine_the_plan_shape(shape, target, ok):
    """The sender copies a view export's tensor through `.view(shape)` of the plan's bytes: only a
    split of the plan's dimensions keeps the elements in place."""
    from opkd_mcore.weight_sync.sender import refines

    assert refines(shape, target) is ok


class FakeGroupFactoryForSelectionTest:
    """Records what the transport asks for instead of building a group (no NPU/second node here)."""

    def __init__(self):
        self.calls = []

    def __call__(self, host, port, rank, world_size, *, backend, timeout_s, join_timeout_s, listener=None,
                 high_priority):
        self.calls.append(dict(host=host, port=port, rank=rank, world_size=world_size, backend=backend,
                               timeout_s=timeout_s, join_timeout_s=join_timeout_s,
                               high_priority=high_priority))
        return object()


@pytest.mark.parametrize("high_priority", [True, False])
@pytest.mark.parametrize("device,backend", [("npu", "hccl"), ("cuda", "nccl"), ("cpu", "gloo")])
def test_backend_and_multinode_host_selection(monkeypatch, device, backend, high_priority):
    import opkd_mcore.weight_sync.group_transport as gt

    fake = FakeGroupFactoryForSelectionTest()
    monkeypatch.setattr(gt, "new_stateless_group", fake)
    cfg = SyncGroupsConfig(host="10.1.2.3", base_port=31000, num_receivers=8, timeout_s=42,
                           join_timeout_s=99, high_priority=high_priority).stage_groups(2)[1]
    cfg.device = device
    transport = make_transport("group", cfg, rank=0)
    transport.connect()
    assert fake.calls == [dict(host="10.1.2.3", port=31001, rank=0, world_size=9, backend=backend, timeout_s=42,
                               join_timeout_s=99, high_priority=high_priority)]


@pytest.mark.gpu
@pytest.mark.parametrize("high_priority", [True, False])
def test_nccl_group_streams_take_the_priority_asked_for(high_priority):
    """A sync group's NCCL streams are high-priority unless asked otherwise: the next bucket's pack
    then does not hold the SMs when a transfer's kernel starts (docs/benchmarks.md)."""
    from opkd_mcore.platform.stateless_group import destroy_stateless_group, new_stateless_group

    pg = new_stateless_group("127.0.0.1", free_port(), 0, 1, backend="nccl", timeout_s=60,
                             high_priority=high_priority)
    try:
        assert pg._get_backend(torch.device("cuda")).options.is_high_priority_stream is high_priority
    finally:
        destroy_stateless_group(pg)


def _occupy(port: int) -> socket.socket | None:
    """Another process's listener on `port` (None when that port is already in use anyway)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def test_listener_moves_off_a_taken_port_and_exact_port_is_refused_clearly():
    from opkd_mcore.platform.stateless_group import PortInUseError, listen_for_group, new_stateless_group

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        listener = listen_for_group("127.0.0.1", port)
        assert listener.port != port and listener.sock.getsockname() == ("127.0.0.1", listener.port)
        listener.close()
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}: the port is taken by another process"):
            new_stateless_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=5)
    finally:
        taken.close()


def _stage_owners_on_taken_ports(rank, world, base_port):
    """Each rank owns one PP stage; the rank that also 'drives the engine' (0) learns every stage's port
    only after the owners bound them, then receives in a thread, as `SpmdWeightSync` does with vLLM."""
    import threading
    from dataclasses import replace

    from opkd_mcore.weight_sync.megatron_source import agree_stage_ports

    groups = SyncGroupsConfig(base_port=base_port, num_receivers=1, timeout_s=60).stage_groups(world)
    transport = make_transport("group", groups[rank], rank=0)
    ports = agree_stage_ports(rank, transport.bind(), world)
    groups = [replace(g, port=p) for g, p in zip(groups, ports)]
    received: dict = {}
    if rank == 0:
        def receive():
            receiver = BucketReceiver()
            receiver.join(groups, rank=1)
            receiver.receive(lambda named: received.update({n: _digest(t) for n, t in named}))
            receiver.close()

        engine = threading.Thread(target=receive)
        engine.start()
    BucketSender(_plan(), transport, rank).sync(iter(_stage_tensors(rank, 6)), 6)
    if rank == 0:
        engine.join(60)
        assert not engine.is_alive(), "receiver did not finish"
    transport.close()
    return {"ports": ports, "received": received}


def test_groups_form_when_the_configured_ports_are_taken():
    from tests._dist import run_distributed

    held = socket.create_server(("127.0.0.1", 0))
    base = held.getsockname()[1]
    held_next = _occupy(base + 1)
    try:
        per_rank = run_distributed(_stage_owners_on_taken_ports, 2, base)
    finally:
        held.close()
        if held_next is not None:
            held_next.close()
    ports = per_rank[0]["ports"]
    assert per_rank[1]["ports"] == ports and ports[0] != base and ports[1] != base + 1
    expected = {n: _digest(t) for s in (0, 1) for n, t in _stage_tensors(s, 6)}
    assert per_rank[0]["received"] == expected


def test_stage_groups_with_base_port_zero_leave_the_choice_to_bind():
    assert [g.port for g in SyncGroupsConfig(base_port=0).stage_groups(3)] == [0, 0, 0]


def test_unknown_transport_lists_available():
    with pytest.raises(ValueError, match=r"unknown 'carrier_pigeon'; available: \['colocated_ipc', 'group'\]"):
        make_transport("carrier_pigeon", TransportConfig(), 0)


def _megatron_sender_with_dying_receiver(rank, world, hf_dir, sync_cfg):
    """TP=2 Megatron job whose receiver dies: both TP ranks must fail (none hangs), weights intact."""
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport

    init_parallel(ParallelConfig(tp=2, seed=3))
    try:
        chunks = build_model(load_hf_config(hf_dir))
        load_hf_weights(chunks, hf_dir)
        before = [p.detach().clone() for p in chunks[0].parameters()]
        sync = MegatronWeightExport(chunks, SyncGroupsConfig(**sync_cfg))
        sync.connect()
        start = time.monotonic()
        try:
            sync.sync(version=1)
            error = None
        except (WeightSyncTimeout, RuntimeError) as err:
            error = f"{type(err).__name__}: {err}"
        elapsed = time.monotonic() - start
        sync.close()
        intact = all(torch.equal(a, b) for a, b in zip(before, chunks[0].parameters()))
        return {"error": error, "elapsed": elapsed, "intact": intact, "owner": sync.sender is not None}
    finally:
        destroy_parallel()


def test_megatron_tp_job_fails_cleanly_when_receiver_dies(tmp_path):
    from dataclasses import asdict

    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
    from tests._dist import run_distributed

    hf_dir = save_tiny_hf_model(str(tmp_path / "tiny"), "qwen3", TinyModelShape(num_key_value_heads=2))
    cfg = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=20, join_timeout_s=300,
                           bucket_bytes=64 * 1024)
    queue = mp.get_context("spawn").Queue()
    receiver = _start(_receiver_proc, 1, cfg.stage_groups(1), 1, 1, queue)  # dies after one bucket
    per_rank = run_distributed(_megatron_sender_with_dying_receiver, 2, hf_dir, asdict(cfg))
    receiver.join(30)
    assert receiver.exitcode == 17
    owner, peer = sorted(per_rank, key=lambda r: not r["owner"])
    assert owner["owner"] and not peer["owner"]
    assert "WeightSyncTimeout" in owner["error"]
    assert "sending rank" in peer["error"]  # the TP peer is told, instead of hanging in the export
    assert all(r["intact"] for r in per_rank)  # the trainer keeps its weights
    assert all(r["elapsed"] < cfg.timeout_s + 10 for r in per_rank)


def _slow_sender_proc(group, delay_s, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        transport = make_transport("group", group, rank=0)
        sender = BucketSender(_plan(), transport, 1)
        events, broadcast = [], transport.broadcast

        def logged_broadcast(buf, nbytes):  # the real broadcast, its order among the exports noted
            events.append("broadcast")
            return broadcast(buf, nbytes)

        def slow_export():  # stands in for an export whose TP gathers take time
            for item in _stage_tensors(1, 5):
                time.sleep(delay_s)
                events.append("export")
                yield item

        transport.broadcast = logged_broadcast
        s = sender.sync(slow_export(), 5)
        queue.put(("sender", 1, (s.last_pack_s, s.last_wait_s, s.last_sync_s, events, s.last_marks)))
        transport.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def _slow_receiver_proc(group, delay_s, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        receiver = BucketReceiver()
        receiver.join([group], 1)
        buckets = []
        receiver.receive(lambda named: (buckets.append(len(named)), time.sleep(delay_s)))
        s = receiver.stats
        queue.put(("receiver", 1, (buckets, s.last_load_s, s.last_wait_s, s.last_sync_s,
                                   dict(s.last_marks, start=s.last_start_t, end=s.last_end_t))))
        receiver.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def test_sync_stats_split_host_time_into_pack_wait_and_load():
    """The phase timings a GPU profile of a sync reads (tools/weight_sync_e2e.py) land where the
    time was spent: a slow export shows as the sender's pack time and the receiver's waits, a slow
    load as the receiver's load time."""
    queue = mp.get_context("spawn").Queue()
    (group,) = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=60).stage_groups(1)
    export_delay, load_delay = 0.05, 0.1
    procs = [_start(_slow_sender_proc, group, export_delay, queue),
             _start(_slow_receiver_proc, group, load_delay, queue)]
    results = {r[0]: r[2] for r in _collect(queue, 2, timeout=120)}
    for p in procs:
        p.join(30)
    assert "error" not in results, results["error"]
    pack_s, send_wait_s, send_total_s, events, send_marks = results["sender"]
    bucket_sizes, load_s, recv_wait_s, recv_total_s, recv_marks = results["receiver"]
    n_buckets, n_tensors = len(bucket_sizes), len(_stage_tensors(1, 0))
    assert sum(bucket_sizes) == n_tensors
    # the header goes out first, so that the receivers have it when they ask; bucket 0 is
    # exported meanwhile, then the plan (this being the group's first sync) and bucket 0 go
    assert events[:bucket_sizes[0] + 3] == ["broadcast"] + ["export"] * bucket_sizes[0] + ["broadcast"] * 2
    assert pack_s >= n_tensors * export_delay
    assert pack_s + send_wait_s <= send_total_s
    assert n_buckets >= 2 and load_s >= n_buckets * load_delay
    assert load_s + recv_wait_s <= recv_total_s
    # the receiver cannot load what the sender has not exported yet. Bucket 0 is exported before
    # the plan goes out (the receiver waits for it in the handshake, outside these counters); the
    # export of the rest it spent loading earlier buckets or waiting, and the last bucket's load
    # comes after all of it
    after_first = (n_tensors - bucket_sizes[0]) * export_delay
    assert recv_wait_s + load_s >= after_first
    assert recv_wait_s >= after_first - load_s * (n_buckets - 1) / n_buckets > 0
    # the timeline (`time.monotonic()`, one clock for both processes): each end's steps in order,
    # and the receiver sees the header only after the sender began to post it, the buckets' bytes
    # only after the handshake (a mark taken once a post returns can come after the peer's: gloo's
    # post returns when the bytes have moved)
    assert _in_order(send_marks, "start", "header_asked", "header_posted", "packed", "handshaken",
                     "posted_last", "end")
    assert _in_order(recv_marks, "start", "header_asked", "header_landed", "header", "posted", "bytes_in",
                     "end")
    assert send_marks["header_asked"] <= recv_marks["header_landed"]
    assert send_marks["handshaken"] <= recv_marks["bytes_in"]
    assert send_marks["packed"] - send_marks["header_posted"] >= bucket_sizes[0] * export_delay


def _in_order(marks: dict[str, float], *names: str) -> bool:
    return [marks[n] for n in names] == sorted(marks[n] for n in names)


def test_sender_host_waits_do_not_grow_with_the_buckets():
    """On an accelerator a tensor built from Python data is a blocking copy: the host then waits for
    every transfer queued before it. The sender builds the header and all trailers once per sync, so
    the count of such ops is the same for one bucket as for many (each bucket's trailer was one)."""
    from tests._host_sync import SyncingOpRecorder

    def host_waits(bucket_bytes: int) -> tuple[int, int]:
        tensors = _stage_tensors(0, 3)
        plan = BucketPlan.from_named_tensors(tensors, bucket_bytes)
        group = TransportConfig(port=free_port(), world_size=1, timeout_s=30)  # no receivers needed
        sender = BucketSender(plan, make_transport("group", group, rank=0), 0)
        sender.sync(iter(tensors), 3)  # the first sync also moves the plan
        with SyncingOpRecorder() as recorder:
            sender.sync(iter(tensors), 4)
        sender.transport.close()
        return len(plan.buckets), len(recorder.seen)

    few, many = host_waits(1 << 20), host_waits(BUCKET_BYTES // 8)
    assert few[0] == 1 and many[0] >= 10, (few, many)
    assert few[1] == many[1], (few, many)
