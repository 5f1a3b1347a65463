"""Process groups outside `torch.distributed`'s default group (weight sync between trainer and rollout).

`new_stateless_group` joins `world_size` processes over a TCP store at `host:port` with the backend of
this device (gloo on CPU, nccl on CUDA, hccl on NPU) and returns a `ProcessGroup` whose ranks are
group-local. The default group, if any, is not touched.

gloo and nccl groups are built here from torch alone, so a trainer without vLLM and a vLLM worker
build them the same way (both ends must: the store keys differ between implementations). Other
backends (hccl) go through vLLM's platform layer (vllm-ascend), which knows how to make them.

Rank 0 serves the store on a socket it binds itself (`listen_for_group`) before any peer is told the
port: choosing a port by binding and closing it, then binding it again later, lets another process
take it in between. `listen_for_group` binds the wanted port and, when it is taken (EADDRINUSE), lets
the OS pick a free one; the caller tells the peers the port it got. The socket is bound to the group's
host only, so a store meant for 127.0.0.1 is not reachable from other machines.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import inspect
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from opkd_mcore.platform.device import collective_backend
from opkd_mcore.platform.tcp_store import bind_listener, store_on_socket

logger = logging.getLogger(__name__)


_TORCH_BUILT = ("gloo", "nccl")
_STORES: dict[int, dist.Store] = {}  # id(group) -> its TCP store, which must outlive the group


class PortInUseError(OSError):
    """The exact port a group was told to use is held by another process."""


@dataclass
class GroupListener:
    """A listening socket on `host:port`, held by rank 0 until its TCP store takes it over."""

    host: str
    port: int
    sock: socket.socket | None

    def take(self) -> socket.socket:
        """Hand the socket over (once): the store now owns it."""
        if self.sock is None:
            raise RuntimeError(f"group listener {self.host}:{self.port}: socket already handed to a store")
        sock, self.sock = self.sock, None
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def listen_for_group(host: str, port: int, *, move_if_taken: bool = True) -> GroupListener:
    """Bind and listen on `host:port` for a group's store (rank 0). Port 0, or a taken port when
    `move_if_taken`, gets a free port from the OS; the returned listener holds the port actually bound,
    which is what the peers must be told."""
    try:
        sock = bind_listener(host, port)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise OSError(err.errno,
                          f"weight-sync group {host}:{port}: cannot listen ({err.strerror})") from err
        if not move_if_taken:
            raise PortInUseError(errno.EADDRINUSE, f"weight-sync group {host}:{port}: the port is taken by "
                                 "another process, and the peers were told this port; bind the group "
                                 "first (it then moves to a free port and tells the peers)") from err
        sock = bind_listener(host, 0)
        logger.warning("weight-sync group: port %d on %s is taken by another process; using %d instead",
                       port, host, sock.getsockname()[1])
    return GroupListener(host, sock.getsockname()[1], sock)


NCCL_CLEAN_UP_ONLY = 2  # TORCH_NCCL_ASYNC_ERROR_HANDLING: abort the failed communicator, keep the process


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _torch_backend(backend: str, store, rank: int, world_size: int, timeout: timedelta,
                   high_priority: bool):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout), torch.device("cpu"), \
            dist.ProcessGroup.BackendType.GLOO
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # the transfers' kernels then get the SMs ahead of copy kernels made ready at the same
        # moment: a weight-sync sender packs bucket i+1 as soon as bucket i-1's transfer ends, which
        # is when bucket i's starts, and at normal priority the pack's blocks took the SMs first
        options.is_high_priority_stream = high_priority
        # read once, by this constructor: on a transfer past the group's timeout (an engine that hung
        # or died mid-sync) the watchdog aborts this group's communicator and the next transfer on it
        # fails, instead of torch's default of taking the whole trainer process down (seen on two
        # GPUs: tests/test_weight_sync_abort_gpu.py), and without first waiting a minute for a flight-
        # recorder dump (the wait holds the group's work list: the trainer's next transfer blocked on it)
        with _environ(TORCH_NCCL_ASYNC_ERROR_HANDLING=str(NCCL_CLEAN_UP_ONLY), TORCH_NCCL_DUMP_ON_TIMEOUT="0",
                      TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="0"):
            pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        return pg, torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL
    raise ValueError(f"backend: expected one of {_TORCH_BUILT}, got {backend!r}")


def _torch_store(host: str, port: int, rank: int, world_size: int, join_timeout: timedelta,
                 listener: GroupListener | None) -> dist.TCPStore:
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=join_timeout,
                             wait_for_workers=True)
    listener = listener or listen_for_group(host, port, move_if_taken=False)
    return store_on_socket(listener.take(), host, world_size, join_timeout, wait_for_workers=True)


def _torch_stateless_group(host: str, port: int, rank: int, world_size: int, backend: str,
                           timeout: timedelta, join_timeout: timedelta,
                           listener: GroupListener | None, high_priority: bool) -> dist.ProcessGroup:
    store = _torch_store(host, port, rank, world_size, join_timeout, listener)
    store.set_timeout(timeout)
    prefix_store = dist.PrefixStore(f"opkd_stateless/{host}:{port}", store)
    pg = dist.ProcessGroup(prefix_store, rank, world_size)
    backend_obj, device, backend_type = _torch_backend(backend, prefix_store, rank, world_size, timeout,
                                                         high_priority)
    pg._set_default_backend(backend_type)
    backend_obj._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, backend_obj)
    _STORES[id(pg)] = store
    return pg


def new_stateless_group(host: str, port: int, rank: int, world_size: int, *,
                        backend: str | None = None, timeout_s: float = 600.0,
                        join_timeout_s: float | None = None,
                        listener: GroupListener | None = None,
                        high_priority: bool = False) -> dist.ProcessGroup:
    """Join a group of `world_size` processes: blocks until all have joined or `join_timeout_s`
    (default `timeout_s`) passes; collectives on the group then time out after `timeout_s`.
    `high_priority`: the group's collectives run on a high-priority device stream (the groups this
    module builds with torch; vLLM's platform layer builds hccl groups at its default priority).

    Rank 0 serves the store on `listener` (from `listen_for_group`, already on the port the peers
    were told); without one it binds exactly `port` and raises `PortInUseError` when that is taken."""
    backend = backend or collective_backend()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if listener is not None and (rank != 0 or listener.port != port):
        raise ValueError(f"listener: only rank 0 serves the store, on the group's port {port}; got rank "
                         f"{rank} with a listener on port {listener.port}")
    timeout = timedelta(seconds=timeout_s)
    join_timeout = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
    if backend in _TORCH_BUILT:
        return _torch_stateless_group(host, port, rank, world_size, backend, timeout, join_timeout, listener,
                                      high_priority)
    return _vllm_stateless_group(host, port, rank, world_size, backend, max(timeout, join_timeout), listener)


def _vllm_stateless_group(host: str, port: int, rank: int, world_size: int, backend: str,
                          timeout: timedelta, listener: GroupListener | None) -> dist.ProcessGroup:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"backend: a stateless {backend!r} group needs vLLM's platform layer "
                         "(vllm-ascend for hccl); it is not installed")
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group as init_group

    kwargs = {}
    if rank == 0 and "listen_socket" in inspect.signature(init_group).parameters:
        kwargs["listen_socket"] = (listener or listen_for_group(host, port, move_if_taken=False)).take()
    elif listener is not None:  # an older vLLM binds the port itself: free it just before
        listener.close()
    return init_group(host, port, rank, world_size, backend, timeout=timeout, **kwargs)


_ABORT_KEY = "opkd_abort"


def signal_abort(pg: dist.ProcessGroup, reason: str) -> None:
    """Tell the group's other members, through its store, that this member is leaving mid-transfer
    (`abort_signalled` reads it). Best effort: a store already gone says as much by itself."""
    store = _STORES.get(id(pg))
    if store is None:
        return
    try:
        store.set(_ABORT_KEY, reason.encode())
    except (RuntimeError, OSError) as err:
        logger.debug("stateless group: abort signal not stored (%s)", err)


def abort_signalled(pg: dist.ProcessGroup) -> str | None:
    """Why the group is being torn down, if a member said so (`signal_abort`) or its store, which
    rank 0 serves, is gone; None while neither (and for groups built without a store of ours).
    A collective blocked on the accelerator cannot see either: its waiter polls this."""
    store = _STORES.get(id(pg))
    if store is None:
        return None
    try:
        if store.check([_ABORT_KEY]):
            return store.get(_ABORT_KEY).decode(errors="replace")
    except (RuntimeError, OSError) as err:   # the server closed the connection: rank 0 left
        return f"the group's store is gone, rank 0 left ({type(err).__name__}: {err})"
    return None


def destroy_stateless_group(pg: dist.ProcessGroup, abort: bool = False) -> None:
    """Release a group made by `new_stateless_group` (idempotent enough for error paths).
    `abort`: a member is gone; NCCL's orderly teardown (`shutdown`, ncclCommFinalize) waits for
    every member, so this end aborts its communicators instead, which waits for nobody and ends a
    collective blocked in another thread. Gloo's abort cannot end such a wait, and a gloo group's
    destructor waits for it, to the collective's timeout: the transports' pending transfers keep
    their group alive (`weight_sync.group_transport`)."""
    try:
        if abort and hasattr(pg, "abort"):
            pg.abort()
        else:
            pg.shutdown()
    except (RuntimeError, AttributeError) as err:  # already torn down by a failed peer
        logger.debug("stateless group %s: %s", "abort" if abort else "shutdown", err)
    _STORES.pop(id(pg), None)
