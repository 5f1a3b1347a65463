"""Process-group stores: bound on the configured address only, and on a port nobody can take between
the moment it is chosen and the moment the store serves it.

The races are shown with real sockets: an "intruder" binds the port the store is about to be built
on, at the last moment before the store is built (or the ranks are started). With a port chosen by
binding and closing a socket the intruder gets it and the store fails (EADDRINUSE); with the socket
handed to the store the intruder is refused and the group starts.
"""
from __future__ import annotations

import errno
import multiprocessing.context
import os
import socket
import sys
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from opkd_mcore.config import TrainConfig
from opkd_mcore.controller import groups as controller_groups
from opkd_mcore.controller.trainer_worker import TrainerWorker
from opkd_mcore.models.convert import launch
from opkd_mcore.platform.tcp_store import serve_store
from tests._dist import run_distributed

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE")


def _listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


class Intruder:
    """Another process's socket: tries to take `port` on the loopback and keeps it if it can. It
    binds without listening, so a rank that connects to it is refused at once instead of waiting
    on a socket that never answers."""

    def __init__(self):
        self.sockets: list[socket.socket] = []
        self.outcomes: list[str] = []

    def take(self, port: int) -> None:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            sock.close()
            self.outcomes.append("refused" if err.errno == errno.EADDRINUSE else str(err))
            return
        self.sockets.append(sock)
        self.outcomes.append("took it")

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def _clear_launcher_env(monkeypatch) -> None:
    for key in LAUNCHER_ENV:
        monkeypatch.setenv(key, "")  # records the old value (or its absence) for the undo
        monkeypatch.delenv(key)


# ----------------------------------------------------------------------------- the shared helper
def test_serve_store_listens_on_the_given_host_only():
    store = serve_store("127.0.0.1", 2, timedelta(seconds=10))
    assert _listening_addresses(store.port) == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", b"v")
    assert store.get("k") == b"v"


# ----------------------------------------------------------------------------- one-rank init_parallel
def _single_process_init(rank, world):
    """`init_parallel` of a plain `python script.py` (no launcher env), with an intruder at the store."""
    from opkd_mcore.platform import parallel

    for key in LAUNCHER_ENV:
        os.environ.pop(key, None)
    intruder = Intruder()
    real = dist.TCPStore

    def store_with_intruder(*args, **kwargs):
        intruder.take(kwargs.get("port", args[1] if len(args) > 1 else None))
        return real(*args, **kwargs)

    dist.TCPStore = store_with_intruder
    # torch's env:// rendezvous builds its store from its own module's name
    sys.modules["torch.distributed.rendezvous"].TCPStore = store_with_intruder
    try:
        parallel._init_process_group("gloo", 1)
        port = int(os.environ["MASTER_PORT"])
        return {"outcomes": intruder.outcomes, "world": dist.get_world_size(),
                "listening": _listening_addresses(port)}
    finally:
        intruder.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_one_rank_init_keeps_its_port_from_choice_to_store():
    (result,) = run_distributed(_single_process_init, 1, backend=None)
    assert result["outcomes"] == ["refused"] and result["world"] == 1
    assert result["listening"] == {"127.0.0.1"}


# ----------------------------------------------------------------------------- the converter's ranks
def _sum_ranks(out_dir: str) -> None:
    import torch

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=20))
    try:
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        with open(os.path.join(out_dir, f"rank_{dist.get_rank()}.txt"), "w") as f:
            f.write(str(int(value.item())))
    finally:
        dist.destroy_process_group()


def test_converter_ranks_keep_their_port_from_choice_to_store(tmp_path, monkeypatch):
    """`opkd convert` spawns its ranks itself; the intruder strikes as the first rank starts."""
    _clear_launcher_env(monkeypatch)
    intruder = Intruder()
    real_start = multiprocessing.context.SpawnProcess.start

    def start(process):
        if not intruder.outcomes:
            intruder.take(process._args[2])  # the port `launch` tells its ranks
        real_start(process)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    try:
        launch(_sum_ranks, 2, str(tmp_path))
    finally:
        intruder.close()
    assert intruder.outcomes == ["refused"]
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["3", "3"]


# ----------------------------------------------------------------------------- the Ray trainer group
def test_trainer_group_store_listens_on_the_rendezvous_host_only(monkeypatch):
    _clear_launcher_env(monkeypatch)  # the worker sets its rank variables in this process
    worker = TrainerWorker(TrainConfig(), rank=0, world_size=2)
    host, port = worker.listen("127.0.0.1")
    assert (host, _listening_addresses(port)) == ("127.0.0.1", {"127.0.0.1"})
    client = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", b"v")
    assert worker._store.get("k") == b"v"


class _Stop(Exception):
    pass


class _ListeningTrainer:
    """Stands in for trainer rank 0's actor: records where it was asked to listen, then stops."""

    def __init__(self):
        self.hosts = []
        self.listen = self

    def remote(self, host):
        self.hosts.append(host)
        raise _Stop


@pytest.mark.parametrize("configured,nodes,expected", [
    ("127.0.0.1", 1, "127.0.0.1"),  # one node: the loopback, unreachable from elsewhere
    ("127.0.0.1", 2, None),  # several nodes and the default: rank 0's node address (one interface)
    ("10.1.2.3", 2, "10.1.2.3"),  # an address the user chose
])
def test_the_trainer_group_is_told_the_configured_host(monkeypatch, configured, nodes, expected):
    import ray

    cfg = TrainConfig()
    cfg.weight_sync.host = configured
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}] * nodes)
    groups = controller_groups.WorkerGroups.__new__(controller_groups.WorkerGroups)
    groups.cfg, groups.trainers = cfg, [_ListeningTrainer()]
    with pytest.raises(_Stop):
        groups._start()
    assert groups.trainers[0].hosts == [expected]
