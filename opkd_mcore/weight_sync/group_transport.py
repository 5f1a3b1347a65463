"""Transport over a stateless process group (gloo on CPU, the accelerator's backend elsewhere).

The group is made from a TCP store at `cfg.host:cfg.port` without touching `torch.distributed`'s
default group, so trainer ranks and rollout workers that belong to different jobs can meet. The
backend comes from `opkd_mcore.platform` for this process's device: multi-node, every accelerator
and CPU take the same path and differ only in the host address and the backend that platform names.

Port agreement: the sender (rank 0) calls `bind()` before the receivers are told the port. It listens
on `cfg.port`, or on a free port when that one is taken (or is 0), and updates `cfg.port`; whoever
starts the receivers passes them the bound port. Without `bind()`, `connect()` uses exactly
`cfg.port` and fails clearly when another process holds it (the receivers were told that port).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from opkd_mcore.platform import collective_backend, current_device
from opkd_mcore.platform.stateless_group import (
    GroupListener,
    abort_signalled,
    destroy_stateless_group,
    listen_for_group,
    new_stateless_group,
    signal_abort,
)
from opkd_mcore.weight_sync.transport import (
    SENDER_RANK,
    PendingTransfer,
    TransportConfig,
    WeightSyncAborted,
    WeightSyncTimeout,
    WeightTransport,
)

logger = logging.getLogger(__name__)
STATUS_BYTES = 1024
# A host waiting for an accelerator transfer (`_GroupWork.wait_host`): yields the core for the first
# SPIN_S (a bucket lands within it; a sleep per poll would add up to a scheduler tick per bucket),
# sleeps SLEEP_S per poll after that, and asks the group's store whether a member left every
# ABORT_POLL_S (one round trip to rank 0's store).
SPIN_S, SLEEP_S, ABORT_POLL_S = 0.05, 1e-3, 0.05


class _GroupWork(PendingTransfer):
    """On CPU, waits on the host with the timeout. On accelerators, orders the current stream after
    the transfer without blocking the host: a host wait with a timeout polls in 1 ms sleeps, which
    costs about that much per bucket. There the group's own timeout (set when it was made) aborts a
    transfer whose peer is gone: its watchdog aborts the communicator (`platform.stateless_group`),
    which releases the stream, and the next transfer on the group fails (`_enqueue`). A host that
    must read the bytes (a receiver's header, plan and trailers) waits with `wait_host`, which polls
    and ends as soon as a member that leaves says so, long before that timeout."""

    def __init__(self, work, what: str, host_wait: bool, group: dist.ProcessGroup,
                 abort_reason: Callable[[], str | None] = lambda: None):
        self.work, self.what, self.host_wait, self.abort_reason = work, what, host_wait, abort_reason
        # a host-waiting (CPU) group's destructor waits for its transfers in flight, in whichever
        # thread drops the group: a `close(abort=True)` beside a blocked wait would hang there, so
        # the transfer holds the group and the waiting thread lets go of it once its wait is over
        self.group = group if host_wait else None

    def wait(self, timeout_s: float) -> None:
        try:
            if self.host_wait:
                self.work.wait(timedelta(seconds=timeout_s))
            else:
                self.work.wait()
        except RuntimeError as err:  # backends report a dead or silent peer as RuntimeError subclasses
            raise WeightSyncTimeout(f"{self.what}: a peer did not finish within {timeout_s:.0f} s "
                                    f"or left the group ({type(err).__name__}: {err})") from err

    def wait_host(self, timeout_s: float) -> None:
        """Polls the transfer rather than waiting inside the backend: a member that leaves says so
        in the group's store (or takes the store with it), and the wait ends then."""
        if self.host_wait:
            return
        start = time.monotonic()
        next_ask = start + ABORT_POLL_S
        while not self.work.is_completed():
            now = time.monotonic()
            if now >= next_ask:
                reason = self.abort_reason()
                if reason is not None:
                    raise WeightSyncAborted(f"{self.what}: abandoned, a member left the group ({reason})")
                next_ask = now + ABORT_POLL_S
            if now - start > timeout_s:
                raise WeightSyncTimeout(f"{self.what}: a peer did not finish within {timeout_s:.0f} s")
            time.sleep(0 if now - start < SPIN_S else SLEEP_S)
        self.wait(timeout_s)   # a transfer that ended in an error raises it here


class StatelessGroupTransport(WeightTransport):
    """Broadcasts over a stateless group; the sender is group rank 0."""

    def __init__(self, cfg: TransportConfig, rank: int):
        super().__init__(cfg, rank)
        self.backend = collective_backend(cfg.device)
        self.pg: dist.ProcessGroup | None = None
        self._listener: GroupListener | None = None

    def bind(self) -> int:
        """Sender: hold the group's port from now on (a free one if `cfg.port` is taken or 0) and
        return it; tell the receivers this port. Receivers: return `cfg.port` (they only connect)."""
        if self.is_sender and self._listener is None and self.pg is None:
            self._listener = listen_for_group(self.cfg.host, self.cfg.port)
            self.cfg = replace(self.cfg, port=self._listener.port)
        return self.cfg.port

    def connect(self) -> None:
        if self.pg is not None:
            return
        try:
            self.pg = new_stateless_group(self.cfg.host, self.cfg.port, self.rank, self.world_size,
                                          backend=self.backend, timeout_s=self.cfg.timeout_s,
                                          join_timeout_s=self._join_timeout_s(), listener=self._listener,
                                          high_priority=self.cfg.high_priority)
        except (RuntimeError, TimeoutError) as err:
            raise WeightSyncTimeout(
                f"weight-sync group {self.cfg.host}:{self.cfg.port} ({self.backend}, world_size="
                f"{self.world_size}): rank {self.rank} could not join within {self._join_timeout_s():.0f} s; "
                f"start both sides concurrently ({type(err).__name__}: {err})") from err
        logger.info("joined weight-sync group %s:%d as rank %d/%d (%s)", self.cfg.host, self.cfg.port,
                    self.rank, self.world_size, self.backend)

    def _join_timeout_s(self) -> float:
        return self.cfg.timeout_s if self.cfg.join_timeout_s is None else self.cfg.join_timeout_s

    @property
    def device(self) -> torch.device:
        return current_device(self.cfg.device)

    def _host_wait(self) -> bool:
        return self.device.type == "cpu"

    def _group(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise RuntimeError("transport: call connect() before moving data")
        return self.pg

    def alloc_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def broadcast(self, buf: torch.Tensor, nbytes: int) -> PendingTransfer:
        what = f"broadcast of {nbytes} bytes on {self.cfg.host}:{self.cfg.port}"
        return self._enqueue(lambda pg: pg.broadcast(buf[:nbytes], SENDER_RANK), what)

    def _enqueue(self, start, what: str) -> _GroupWork:
        pg = self._group()
        try:
            work = start(pg)
        except RuntimeError as err:  # a group aborted by its watchdog (a peer timed out) takes no more work
            raise WeightSyncTimeout(f"{what}: the group takes no more transfers (aborted after one ran past "
                                    f"its timeout of {self.cfg.timeout_s:.0f} s, or a peer left; "
                                    f"{type(err).__name__}: {err})") from err
        return _GroupWork(work, what, self._host_wait(), pg, self._abort_reason)

    def _abort_reason(self) -> str | None:
        pg = self.pg
        return "this end closed the group" if pg is None else abort_signalled(pg)

    def exchange_status(self, message: str) -> list[str]:
        table = torch.zeros(self.world_size, STATUS_BYTES, dtype=torch.int32, device=self.device)
        raw = message.encode()[:STATUS_BYTES]
        if raw:
            table[self.rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        work = self._enqueue(lambda pg: pg.allreduce([table], opts), "status exchange")
        work.wait_for_host(self.cfg.timeout_s)
        rows = table.cpu().tolist()
        return [bytes(v for v in row if v).decode(errors="replace") for row in rows]

    def close(self, abort: bool = False) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.pg is not None:
            if abort:   # the other members may be waiting for a transfer that will not come
                signal_abort(self.pg, f"rank {self.rank} aborted the weight sync")
            destroy_stateless_group(self.pg, abort=abort)
            self.pg = None
