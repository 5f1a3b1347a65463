"""The engine link of the torchrun layout (`SpmdWeightSync`) and a transport's close: both ends of a
group leave together, the engine is paused around a sync and resumed after a failed one, and a group
whose peer died is aborted rather than waited on."""
from __future__ import annotations

import concurrent.futures as cf
import threading
from types import SimpleNamespace

import pytest

from opkd_mcore.weight_sync import TransportConfig, make_transport
from opkd_mcore.weight_sync.engine_link import SpmdWeightSync
from tests._dist import free_port


class _TeardownWaitsForPeer:
    """A group end whose teardown returns only once the other end tears down too, as an accelerator
    group's does (NCCL's finalize): closing one end, then the other, never returns."""

    def __init__(self, mine, peers):
        self.mine, self.peers = mine, peers

    def close(self) -> None:
        assert isinstance(self.mine, threading.Event)
        self.mine.set()
        if not all(p.wait(timeout=10) for p in self.peers):
            raise TimeoutError("teardown: the other end never closed")


def test_engine_link_closes_both_ends_at_once():
    """`SpmdWeightSync.close` (the torchrun layout's rank that drives the engine): the stage owner
    and the engine's workers leave together; one after the other hung until a time limit on two GPUs."""
    trainer_end, engine_end = threading.Event(), threading.Event()
    export = _TeardownWaitsForPeer(trainer_end, [engine_end])
    export.cfg = SimpleNamespace(timeout_s=30)
    link = SpmdWeightSync(export, _TeardownWaitsForPeer(engine_end, [trainer_end]))
    link.close()
    assert trainer_end.is_set() and engine_end.is_set()


class _RecordingEnds:
    """The export, the engine's receiver handle and the rollout of `SpmdWeightSync`, recording calls."""

    def __init__(self, loaded=None, fail_export=False):
        self.calls, self.loaded, self.fail_export = [], loaded, fail_export
        self.cfg = SimpleNamespace(timeout_s=30)
        self._future = cf.Future

    def sync(self, version):  # the export
        self.calls.append(f"export v{version}")
        if self.fail_export:
            raise RuntimeError("export failed")

    def receive_async(self, version):  # the handle
        self.calls.append(f"receive v{version} posted")
        future = self._future()
        future.set_result(self.loaded or [version])
        return future

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def set_weight_version(self, version, engine_stamped=False):
        self.calls.append(f"version v{version} engine_stamped={engine_stamped}")


def test_spmd_sync_pauses_the_engine_around_send_and_receive():
    """On the engine's rank: the engine paused, the receive posted before the send, the version
    recorded as stamped by the engine, then resumed; other ranks only send."""
    ends = _RecordingEnds()
    assert SpmdWeightSync(ends, handle=ends, rollout=ends).sync(3) == 3
    assert ends.calls == ["pause", "receive v3 posted", "export v3", "version v3 engine_stamped=True", "resume"]
    other_rank = _RecordingEnds()
    SpmdWeightSync(other_rank).sync(3)
    assert other_rank.calls == ["export v3"]


@pytest.mark.parametrize("ends, error", [(dict(fail_export=True), "export failed"),
                                         (dict(loaded=[3, 2]), r"workers report versions \[3, 2\], expected 3")])
def test_spmd_sync_failure_resumes_the_engine_without_a_new_version(ends, error):
    ends = _RecordingEnds(**ends)
    with pytest.raises(RuntimeError, match=error):
        SpmdWeightSync(ends, handle=ends, rollout=ends).sync(3)
    assert ends.calls[0] == "pause" and ends.calls[-1] == "resume"
    assert not any(c.startswith("version") for c in ends.calls)


class _GroupWhoseShutdownWaitsForADeadPeer:
    """Stands in for an NCCL group one of whose members died: the orderly teardown (`shutdown`,
    ncclCommFinalize) would wait for it; `abort` returns."""

    def __init__(self):
        self.calls = []

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        raise AssertionError("shutdown would wait for the dead member forever")

    def abort(self) -> None:
        self.calls.append("abort")


@pytest.mark.parametrize("name", ["group", "colocated_ipc"])
def test_leaving_a_group_whose_peer_died_aborts_instead_of_waiting(name):
    """After an engine died, the trainer leaves the old group alone (the controller's recovery):
    that end must abort, not run the teardown that waits for every member."""
    transport = make_transport(name, TransportConfig(port=free_port(), world_size=2), rank=0)
    group_end = transport.control if name == "colocated_ipc" else transport
    group_end.pg = dead = _GroupWhoseShutdownWaitsForADeadPeer()
    transport.close(abort=True)
    assert dead.calls == ["abort"] and group_end.pg is None
