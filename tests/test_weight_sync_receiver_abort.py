"""A receiver blocked in a weight sync hears at once that the sender left, in real processes.

On an accelerator a receiver's transfer only orders a device stream; its host waits when it must read
the bytes (the header, the plan, a bucket's trailer). When the trainer abandons a sync (an engine of
the group died, the controller rebuilds the groups: `close_weight_sync(abort=True)`), an NCCL
communicator's abort tells its peers nothing, so a surviving engine's worker used to stay inside its
receive until the group's own timeout (`controller.sync_timeout_s`), and its next call (joining the
new groups) waited behind it. Now the leaving member says so in the group's TCP store
(`platform.stateless_group.signal_abort`), or takes the store with it when it is rank 0, and the
host's wait (`_GroupWork.wait_host`) polls the transfer and the store, and raises `WeightSyncAborted`.

Over gloo (CI has no accelerator) the receiver's transfers block the host inside gloo, so the
receiver here wraps each gloo transfer in `_StreamOrderedWork`, a test double of an accelerator's:
`wait()` returns at once (it would order a stream) and only `is_completed()` tells that the bytes
are there. The sender keeps its group open after it signals, as an NCCL peer that aborted its
communicator would look to the others: only the store can end the receiver's wait.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

from opkd_mcore.platform.stateless_group import abort_signalled, new_stateless_group, signal_abort
from opkd_mcore.weight_sync import BucketSender, TransportConfig, WeightSyncAborted, make_transport
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from tests._dist import free_port
from tests.test_weight_sync_transport import _collect, _digest, _plan, _stage_tensors, _start

GROUP_TIMEOUT_S = 120.0   # what the receiver would wait without the signal
HEARD_WITHIN_S = 5.0      # the poll asks the store every 50 ms
REASON = "the controller rebuilds the weight sync"


class _StreamOrderedWork:
    """Test double of an accelerator transfer: `wait` returns at once (it would only order a device
    stream); the host learns that the bytes landed from `is_completed`."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args):
        return True

    def is_completed(self):
        return self.work.is_completed()


def _as_accelerator_receiver() -> None:
    from opkd_mcore.weight_sync import group_transport

    original = group_transport._GroupWork.__init__

    def init(self, work, what, host_wait, group, abort_reason=lambda: None):
        original(self, _StreamOrderedWork(work), what, False, group, abort_reason)

    group_transport._GroupWork.__init__ = init


def _sender_proc(group: TransportConfig, go, done, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        transport = make_transport("group", group, rank=0)
        BucketSender(_plan(), transport, 0).sync(iter(_stage_tensors(0, 1)), 1)
        go.wait(60)             # the receiver is in its second receive, which gets no sync
        time.sleep(0.5)
        signal_abort(transport.pg, REASON)
        queue.put(("sender", "signalled", time.monotonic()))
        done.wait(60)           # the group stays open: its transfers alone would not end the wait
        transport.close(abort=True)
    except BaseException:
        queue.put(("sender", "error", traceback.format_exc()))


def _receiver_proc(group: TransportConfig, go, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        _as_accelerator_receiver()
        receiver = BucketReceiver()
        receiver.join([group], rank=1)
        digests = {}
        version = receiver.receive(lambda named: digests.update({n: _digest(t) for n, t in named}))
        queue.put(("receiver", "received", (version, digests)))
        go.set()
        try:
            receiver.receive(lambda named: None)
            queue.put(("receiver", "returned", None))
        except WeightSyncAborted as err:
            queue.put(("receiver", "aborted", (time.monotonic(), str(err))))
        receiver.close(abort=True)
    except BaseException:
        queue.put(("receiver", "error", traceback.format_exc()))


def test_a_receiver_waiting_on_the_host_hears_that_the_sender_left():
    ctx = mp.get_context("spawn")
    queue, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    group = TransportConfig(port=free_port(), world_size=2, timeout_s=GROUP_TIMEOUT_S, join_timeout_s=60.0,
                            device="cpu")
    procs = [_start(_receiver_proc, group, go, queue), _start(_sender_proc, group, go, done, queue)]
    try:
        got = {}
        for who, what, value in _collect(queue, 3, timeout=90):
            assert what != "error", f"{who}: {value}"
            got[what] = value
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # the polling wait still delivers a sync bit for bit
    version, digests = got["received"]
    assert version == 1 and digests == {n: _digest(t) for n, t in _stage_tensors(0, 1)}
    assert "returned" not in got, "the second receive returned although no sync was sent"
    heard_at, message = got["aborted"]
    assert REASON in message, message
    assert heard_at - got["signalled"] < HEARD_WITHIN_S, (heard_at - got["signalled"], message)


def _store_owner(port: int, ready, queue):
    try:
        pg = new_stateless_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=60)
        ready.set()
        queue.put(("owner", "joined", abort_signalled(pg)))
        time.sleep(1.0)
        os._exit(0)   # leaves without a word: its store goes with it
    except BaseException:
        queue.put(("owner", "error", traceback.format_exc()))


def test_a_member_sees_that_rank_0_and_its_store_are_gone():
    """The other signal: rank 0 (the sender, which serves the group's store) exits without a word;
    the store's connection closes and `abort_signalled` says so on the next question."""
    ctx = mp.get_context("spawn")
    queue, ready = ctx.Queue(), ctx.Event()
    port = free_port()
    owner = _start(_store_owner, port, ready, queue)
    try:
        pg = new_stateless_group("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=60)
        assert abort_signalled(pg) is None
        who, what, value = queue.get(timeout=60)
        assert (what, value) == ("joined", None), value
        owner.join(timeout=30)
        deadline = time.monotonic() + HEARD_WITHIN_S
        reason = None
        while reason is None and time.monotonic() < deadline:
            reason = abort_signalled(pg)
            time.sleep(0.05)
        assert reason is not None and "store is gone" in reason, reason
    finally:
        if owner.is_alive():
            owner.kill()
