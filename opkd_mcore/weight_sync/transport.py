"""Transports: how bucket bytes get from a trainer stage owner to the rollout workers.

One small interface, one registry. A transport connects one sender (group rank 0, a PP stage's
owner) with the rollout workers (group ranks 1..N) and moves flat uint8 buffers from the sender to
every receiver. Every registration lives in `TRANSPORTS` below; modules are imported only when used.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

SENDER_RANK = 0


class WeightSyncTimeout(TimeoutError):
    """A peer did not answer within the configured timeout (dead or stuck receiver/sender)."""


class WeightSyncAborted(WeightSyncTimeout):
    """A member of the group said it is leaving (or its store went away) while this end waited."""


@dataclass
class TransportConfig:
    """Where and how one sync group meets."""

    host: str = "127.0.0.1"  # address of the sender's TCP store (the stage owner's node for multi-node)
    port: int = 29700  # TCP store port of this group; one port per PP stage group
    world_size: int = 2  # 1 sender + number of rollout workers
    timeout_s: float = 300.0  # every transfer must finish within this
    join_timeout_s: float | None = None  # group creation (waits for the slower side); None = timeout_s
    device: str | None = None  # None: this process's device from opkd_mcore.platform
    high_priority: bool = True  # accelerators: transfers on a high-priority stream (platform.stateless_group)
    options: dict = field(default_factory=dict)  # transport-specific extras


class PendingTransfer(ABC):
    """An in-flight transfer; `wait` raises WeightSyncTimeout when the peer does not finish in time."""

    # where the bytes are once `wait` returned, for a transfer from `receive_lent` (the sender's own
    # buffer); None: in the buffer given to `broadcast`
    landed: torch.Tensor | None = None

    @abstractmethod
    def wait(self, timeout_s: float) -> None: ...

    def wait_host(self, timeout_s: float) -> None:
        """After `wait`, before the host reads the bytes: the host, too, waits until they are there.
        A no-op where `wait` already blocks the host. Where it only orders a device stream, this
        polls, so that the wait ends (`WeightSyncAborted`) as soon as a member of the group leaves,
        rather than when the backend's own timeout ends the transfer on the device."""

    def wait_for_host(self, timeout_s: float) -> None:
        """`wait`, then `wait_host`: for bytes the host reads as soon as they land."""
        self.wait(timeout_s)
        self.wait_host(timeout_s)

    def release(self) -> None:
        """The receiver's reads of `landed` are queued: once they finish the sender may refill it
        (a no-op for a transfer into the receiver's own buffer)."""


class WeightTransport(ABC):
    """Moves uint8 buffers from group rank 0 (sender) to ranks 1..N (receivers)."""

    def __init__(self, cfg: TransportConfig, rank: int):
        if not 0 <= rank < cfg.world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={cfg.world_size}, got {rank}")
        self.cfg, self.rank = cfg, rank

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER_RANK

    @property
    def broadcast_waits(self) -> bool:
        """True where `broadcast` itself blocks the sender's host until the receivers take part
        (a handshake per transfer), rather than only queuing the transfer."""
        return False

    @property
    def lends_buffers(self) -> bool:
        """True on a receiver that reads the sender's buffers in place (`receive_lent`): a copy
        into a buffer of its own would only move every byte once more on the same device."""
        return False

    def receive_lent(self, nbytes: int) -> PendingTransfer:
        """Receiver of a lending transport: the next transfer, `landed` in the sender's buffer until
        `release()` (which must come before the next transfer's `wait`)."""
        raise NotImplementedError(f"{type(self).__name__} does not lend its buffers")

    def lent_buffers(self) -> list[torch.Tensor]:
        """The sender's buffers a lending receiver has opened so far."""
        return []

    def bind(self) -> int:
        """Sender: hold the group's port before the receivers are told it; returns the port (a
        transport without a listening side just returns the configured one)."""
        return self.cfg.port

    @abstractmethod
    def connect(self) -> None:
        """Join the group (blocks until every member joined, or raises WeightSyncTimeout)."""

    @abstractmethod
    def alloc_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer on the device this transport moves bytes from/to (reused across syncs)."""

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, nbytes: int) -> PendingTransfer:
        """Start moving `buf[:nbytes]` from the sender into the same region of every receiver's buffer."""

    @abstractmethod
    def exchange_status(self, message: str) -> list[str]:
        """Every member contributes a short text (empty = fine); all get every member's text."""

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Leave the group. `abort`: another member is gone (an engine died); do not wait for it."""


# name -> (module, class). The only place transports are registered.
TRANSPORTS: dict[str, tuple[str, str]] = {
    "group": ("opkd_mcore.weight_sync.group_transport", "StatelessGroupTransport"),
    "colocated_ipc": ("opkd_mcore.weight_sync.colocated_ipc", "ColocatedIpcTransport"),
}


def make_transport(name: str, cfg: TransportConfig, rank: int) -> WeightTransport:
    """Instantiate a registered transport (not yet connected)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport: unknown {name!r}; available: {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[name]
    return getattr(importlib.import_module(module), cls)(cfg, rank)
