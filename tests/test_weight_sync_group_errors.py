"""A weight-sync group that failed: what the trainer's end raises, and how its NCCL groups are built so
that a peer past the group's timeout aborts the group, not the trainer (no GPU here: stand-ins for the
group, named as such; `tests/test_weight_sync_abort_gpu.py` runs the real thing on two GPUs)."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from opkd_mcore.weight_sync import TransportConfig, WeightSyncTimeout, make_transport
from tests._dist import free_port

SETTINGS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC")


class _AbortedGroup:
    """Stands in for an NCCL group that its watchdog aborted (a transfer ran past the timeout)."""

    def broadcast(self, *args):
        raise RuntimeError("NCCL communicator was aborted on rank 0")

    allreduce = broadcast


def test_a_group_that_takes_no_more_work_fails_the_sync_naming_it():
    group = TransportConfig(port=free_port(), world_size=2, timeout_s=7)
    transport = make_transport("group", group, rank=0)
    transport.pg = _AbortedGroup()
    expected = (f"broadcast of 16 bytes on 127.0.0.1:{group.port}: the group takes no more transfers "
                ".*timeout of 7 s.*communicator was aborted")
    with pytest.raises(WeightSyncTimeout, match=expected):
        transport.broadcast(torch.zeros(16, dtype=torch.uint8), 16)
    with pytest.raises(WeightSyncTimeout, match="status exchange: the group takes no more transfers"):
        transport.exchange_status("ok")
    transport.pg = None
    with pytest.raises(RuntimeError, match="call connect\\(\\) before moving data"):
        transport.broadcast(torch.zeros(16, dtype=torch.uint8), 16)


def test_nccl_weight_sync_groups_abort_their_communicator_instead_of_the_process(monkeypatch):
    """torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING when it builds a ProcessGroupNCCL; its default takes the
    process down when a transfer times out. A weight-sync group is built with 2 (abort the communicator
    only), and the process's own setting is left as it was. (A recording stand-in for ProcessGroupNCCL:
    no GPU here; tests/test_weight_sync_abort_gpu.py checks the behaviour on two GPUs.)"""
    import torch.distributed as dist

    from opkd_mcore.platform import stateless_group

    seen = {}

    class RecordingProcessGroupNCCL:
        class Options:
            pass

        def __init__(self, store, rank, world_size, options):
            seen.update({k: os.environ.get(k) for k in SETTINGS})
            seen["timeout"] = options._timeout
            seen["high_priority"] = options.is_high_priority_stream

    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingProcessGroupNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    stateless_group._torch_backend("nccl", None, 0, 2, timedelta(seconds=5), high_priority=True)
    assert seen == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0", "timeout": timedelta(seconds=5),
                    "high_priority": True}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
