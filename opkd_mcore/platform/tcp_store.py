"""TCP stores served on a socket bound before anyone is told the port, on one address only.

Two races and one exposure that this module exists to avoid:

* choosing a port by binding a socket, closing it and handing the number on lets another process
  take the port before the store binds it again (the store then fails with EADDRINUSE);
* `torch.distributed.TCPStore(host, port, is_master=True)` listens on every interface, whatever
  `host` says: an unauthenticated store (which holds the process groups' rendezvous and, through
  `broadcast_object_list`, pickled objects) would be reachable from other machines.

`serve_store` binds a listening socket on `host` (port 0: the OS picks a free one) and hands that
very socket to the store (`master_listen_fd`), so the port is never free between the choice and the
store, and the store answers on `host` only. The process groups' other members connect as clients.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def bind_listener(host: str, port: int = 0) -> socket.socket:
    """A socket listening on `host:port` (port 0: one the OS picks); OSError (EADDRINUSE when the
    port is taken) otherwise, with the socket closed."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # a port left in TIME_WAIT by an earlier run is free to reuse; a listening one is still refused
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def store_on_socket(sock: socket.socket, host: str, world_size: int | None, timeout: timedelta, *,
                    wait_for_workers: bool = False) -> dist.TCPStore:
    """The master TCP store of a group, served on `sock` (from `bind_listener`), which it takes over:
    the caller must not use or close `sock` afterwards, whatever happens."""
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise


def serve_store(host: str, world_size: int | None, timeout: timedelta, *, port: int = 0,
                wait_for_workers: bool = False) -> dist.TCPStore:
    """Serve a group's master store on `host` only, on `port` (0: a free one; `store.port` says
    which). Clients join with `TCPStore(host, store.port, world_size, is_master=False)`."""
    return store_on_socket(bind_listener(host, port), host, world_size, timeout,
                           wait_for_workers=wait_for_workers)
