"""A surviving receiver over NCCL leaves an abandoned sync at once, drains, and joins the new groups.

The engine side of the controller's rebuild (`tests/test_weight_sync_abort_gpu.py` checks the
trainer's side): with several rollout engines, one dies mid-sync and the trainer leaves the group with
`close(abort=True)`. An NCCL communicator's abort tells the other members nothing, so a surviving
engine's worker stayed inside its receive (its host waiting for a header or a trailer whose
broadcast will never come) until the group's timeout. The leaving sender now says so in the group's
store, or takes the store with it, and the receiver's host wait polls both
(`_GroupWork.wait_host`). Here, with real processes and NCCL (sender on GPU 0, receiver on GPU 1,
`BucketReceiver`, the code the vLLM worker extension runs):

- sync 1 arrives bit for bit through the polling waits;
- the receiver enters its second receive; the sender aborts instead of sending: the receive raises
  `WeightSyncAborted` within 5 s although the group's timeout is 120 s;
- the receiver leaves the old group with `close(abort=True)` (what `opkd_join_weight_sync` does with
  a receiver still held) and its device drains (the pending broadcast's kernel ends);
- both join a new group, and sync 2 arrives bit for bit.

Needs two CUDA devices; marked `gpu`.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest
import torch

from opkd_mcore.weight_sync import BucketSender, TransportConfig, WeightSyncAborted, make_transport
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from tests._dist import free_port
from tests.test_weight_sync_abort_gpu import (
    SENDER_GPU,
    _InThread,
    _model,
    _plan,
    _require_two_gpus,
    _setup_child,
)
from tests.test_weight_sync_transport import _digest, _start

RECEIVER_GPU = 1
GROUP_TIMEOUT_S = 120.0
HEARD_WITHIN_S = 5.0
STEP_LIMIT_S = 30.0


def _sender_proc(old: TransportConfig, new: TransportConfig, go, queue):
    try:
        _setup_child(SENDER_GPU)
        device = torch.device("cuda", SENDER_GPU)
        transport = make_transport("group", old, rank=0)
        BucketSender(_plan(), transport, 0).sync(iter([(n, t.to(device)) for n, t in _model(1)]), 1)
        torch.cuda.synchronize(device)
        go.wait(120)             # the receiver is in its second receive
        time.sleep(0.5)
        queue.put(("sender", "abort", {"t": time.monotonic()}))
        transport.close(abort=True)
        fresh = make_transport("group", new, rank=0)
        BucketSender(_plan(), fresh, 0).sync(iter([(n, t.to(device)) for n, t in _model(2)]), 2)
        torch.cuda.synchronize(device)
        fresh.close()
        queue.put(("sender", "done", {}))
    except BaseException:
        queue.put(("sender", "error", {"traceback": traceback.format_exc()}))


def _receive(receiver: BucketReceiver) -> tuple[int, dict[str, str]]:
    digests = {}
    version = receiver.receive(lambda named: digests.update({n: _digest(t.cpu()) for n, t in named}))
    return version, digests


def _receiver_proc(old: TransportConfig, new: TransportConfig, go, queue):
    try:
        _setup_child(RECEIVER_GPU)
        receiver = BucketReceiver()
        receiver.join([old], rank=1)
        version, digests = _receive(receiver)
        queue.put(("receiver", "sync1", {"version": version, "digests": digests}))
        go.set()
        try:
            _receive(receiver)
            queue.put(("receiver", "sync_abandoned", {"outcome": "returned"}))
        except WeightSyncAborted as err:
            queue.put(("receiver", "sync_abandoned", {"outcome": "aborted", "t": time.monotonic(),
                                                      "error": str(err)[:300]}))
        leave = _InThread(lambda: receiver.close(abort=True), RECEIVER_GPU)
        drain = (leave.wait(STEP_LIMIT_S)
                 and _InThread(torch.cuda.synchronize, RECEIVER_GPU).wait(STEP_LIMIT_S))
        queue.put(("receiver", "left", {"close": leave.outcome(), "drained": bool(drain)}))
        if not drain:
            return
        fresh = BucketReceiver()
        fresh.join([new], rank=1)
        version, digests = _receive(fresh)
        queue.put(("receiver", "sync2", {"version": version, "digests": digests}))
        fresh.close()
    except BaseException:
        queue.put(("receiver", "error", {"traceback": traceback.format_exc()}))


def _expect(version: int, got: dict, story: str) -> None:
    expected = {n: _digest(t) for n, t in _model(version)}
    assert got.get("version") == version and got.get("digests") == expected, story


@pytest.mark.gpu
def test_surviving_receiver_leaves_an_abandoned_sync_at_once_and_syncs_over_a_new_group():
    _require_two_gpus()
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    port = free_port(2)
    old, new = (TransportConfig(port=p, world_size=2, timeout_s=GROUP_TIMEOUT_S, join_timeout_s=120.0,
                                device="cuda") for p in (port, port + 1))
    procs = [_start(_receiver_proc, old, new, go, queue), _start(_sender_proc, old, new, go, queue)]
    reports = []
    try:
        deadline = time.monotonic() + 300
        while len(reports) < 6 and time.monotonic() < deadline:
            try:
                reports.append(queue.get(timeout=1))
            except Exception:   # queue.Empty: check for dead processes below
                if not any(p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    story = "\n".join(f"  {who}: {step}: {info}" for who, step, info in reports)
    steps = {(who, step): info for who, step, info in reports}
    assert not [r for r in reports if r[1] == "error"], story
    _expect(1, steps.get(("receiver", "sync1"), {}), story)
    abandoned = steps.get(("receiver", "sync_abandoned"), {})
    assert abandoned.get("outcome") == "aborted", story
    assert abandoned["t"] - steps[("sender", "abort")]["t"] < HEARD_WITHIN_S, story
    left = steps.get(("receiver", "left"), {})
    assert left.get("close", {}).get("outcome") == "returned" and left.get("drained"), story
    _expect(2, steps.get(("receiver", "sync2"), {}), story)
    assert ("sender", "done") in steps, story
