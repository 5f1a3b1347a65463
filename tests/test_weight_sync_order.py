"""The receivers' order over several sources, in real processes over gloo.

Two sender processes stand in for an MoE student at EP=2 (source 0: the shared tensors and experts
0-1, source 1: experts 2-3, both in the export's HF order); one receiver process (`BucketReceiver`,
the code the vLLM extension runs) records the tensors of every load. The plan's "layer" order
makes the receiver load layer L of both sources before any tensor of layer L+1, which is what lets
vLLM's layerwise reload finish an MoE layer before the next one arrives; every tensor still
arrives bit for bit, over two syncs (the second reuses the receive buffers).
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from opkd_mcore.weight_sync import BucketPlan, BucketSender, make_transport
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from opkd_mcore.weight_sync.megatron_source import SyncGroupsConfig, receive_order
from opkd_mcore.weight_sync.plan import tensor_group
from tests._dist import free_port

LAYERS, EXPERTS, HIDDEN = 3, 4, 32
# one layer's share per bucket and source: source 0's layer is 41,216 bytes, source 1's 24,576
BUCKET_BYTES = 44 * 1024


def _source_of(name: str) -> int:
    return int(".experts." in name and int(name.split(".")[5]) >= EXPERTS // 2)


def _model(version: int) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in HF order; values depend on the version."""
    g = torch.Generator().manual_seed(version)
    out = [("model.embed_tokens.weight", torch.randn(100, HIDDEN, generator=g))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", torch.randn(HIDDEN, HIDDEN, generator=g)),
                (p + "self_attn.k_proj.weight", torch.randn(HIDDEN // 2, HIDDEN, generator=g)),
                (p + "self_attn.v_proj.weight", torch.randn(HIDDEN // 2, HIDDEN, generator=g)),
                (p + "mlp.gate.weight", torch.randn(2 * HIDDEN, HIDDEN, generator=g)),
                (p + "input_layernorm.weight", torch.randn(HIDDEN, generator=g))]
        out += [(p + f"mlp.experts.{e}.{w}.weight", torch.randn(HIDDEN, HIDDEN, generator=g))
                for e in range(EXPERTS) for w in ("gate_proj", "up_proj", "down_proj")]
    return out + [("model.norm.weight", torch.randn(HIDDEN, generator=g)),
                  ("lm_head.weight", torch.randn(100, HIDDEN, generator=g))]


def _plan(order: str) -> BucketPlan:
    from opkd_mcore.models import WeightMeta

    meta = [WeightMeta(n, tuple(t.shape), t.dtype, _source_of(n)) for n, t in _model(0)]
    return BucketPlan.from_metadata(meta, BUCKET_BYTES, order)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sender_proc(source, group, versions, order, transport_name, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        transport = make_transport(transport_name, group, rank=0)
        sender = BucketSender(_plan(order), transport, source)
        for v in versions:
            sender.sync(((n, t) for n, t in _model(v) if _source_of(n) == source), v)
        queue.put(("sender", source, sender.stats.syncs))
        transport.close()
    except BaseException:
        queue.put(("error", source, traceback.format_exc()))


def _receiver_proc(groups, versions, transport_name, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        receiver = BucketReceiver()
        receiver.join(groups, 1, transport=transport_name)
        per_sync = []
        for v in versions:
            loads: list[list[tuple[str, str]]] = []
            assert receiver.receive(lambda named: loads.append([(n, _digest(t)) for n, t in named])) == v
            order = [(stage, index) for stage, index, _, _ in receiver.stats.last_buckets]
            per_sync.append((loads, order))
        queue.put(("receiver", 1, per_sync))
        receiver.close()
    except BaseException:
        queue.put(("error", 1, traceback.format_exc()))


def _sync(order: str, transport_name: str, versions: list[int]) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    groups = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=60).stage_groups(2)
    procs = [ctx.Process(target=_sender_proc, args=(s, groups[s], versions, order, transport_name, queue))
             for s in (0, 1)]
    procs.append(ctx.Process(target=_receiver_proc, args=(groups, versions, transport_name, queue)))
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[0][2]
    assert sorted(r[2] for r in results if r[0] == "sender") == [len(versions)] * 2
    (per_sync,) = [r[2] for r in results if r[0] == "receiver"]
    return per_sync


def _most_layers_in_flight(loads) -> int:
    """The most layers, after any load, of which one source's tensors were loaded and the other's
    not yet: what an engine that finishes a layer once all of it arrived holds at once."""
    seen: dict[int, set[int]] = {}
    most = 0
    for load in loads:
        for n, _ in load:
            if ".layers." in n:
                seen.setdefault(int(n.split(".")[2]), set()).add(_source_of(n))
        most = max(most, sum(len(sources) == 1 for sources in seen.values()))
    return most


def _layers(loads) -> list[int]:
    """The decoder layer of every loaded layer tensor, in the order loaded."""
    return [int(tensor_group(n).split(".")[2]) for load in loads for n, _ in load if ".layers." in n]


@pytest.mark.parametrize("transport_name", ["group", "colocated_ipc"])
def test_two_sources_are_loaded_layer_by_layer_and_bitwise(transport_name):
    versions = [3, 4]
    for v, (loads, order) in zip(versions, _sync("layer", transport_name, versions)):
        # both sources' share of layer L is loaded before any tensor of layer L + 1
        assert _layers(loads) == sorted(_layers(loads))
        assert [s for s, _ in order] == [0, 0, 1, 0, 1, 0, 1, 0]  # the buckets alternate by layer
        # source 1's share of a layer is loaded right after source 0's: one layer in flight at most
        assert _most_layers_in_flight(loads) == 1
        assert dict(n for load in loads for n in load) == {n: _digest(t) for n, t in _model(v)}


def test_source_order_drains_the_sources_one_after_another():
    (loads, order), = _sync("source", "group", [5])
    assert [s for s, _ in order] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert _layers(loads) != sorted(_layers(loads))  # what the "layer" order avoids
    assert _most_layers_in_flight(loads) == LAYERS
    assert dict(n for load in loads for n in load) == {n: _digest(t) for n, t in _model(5)}


def test_receive_order_is_by_layer_unless_a_rank_exports_two_sources():
    # without a process group: this rank alone decides
    assert receive_order(1) == "layer" and receive_order(0) == "layer"
    assert receive_order(2) == "source"
