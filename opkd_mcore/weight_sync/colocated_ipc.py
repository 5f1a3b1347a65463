"""Colocated transport: trainer and rollout worker share a device; bytes move by IPC handles.

The sender's two bucket buffers (and the small header/plan buffers) are exported once as IPC
handles; afterwards each transfer is a short control message (buffer id, byte count) over a CPU gloo
group and an acknowledgement. A bucket receiver reads the sender's buffer in place
(`receive_lent`): its loaders copy each byte once, from the sender's bucket into the engine's
weights, and it acknowledges once those copies are done; `broadcast` (headers, the plan) copies
into the receiver's own buffer and acknowledges at once. The sender waits for the
acknowledgement before it reuses a buffer, so a buffer is never overwritten while a receiver still
reads it; with two buffers, packing one overlaps the receivers' load of the other. On accelerators
the handles are device IPC handles; on CPU the buffers live in shared memory (sharing strategy
"file_system"), which is how this path is tested on a CPU-only machine.

The control group is not authenticated, so nothing received is unpickled: a handle travels as plain
numbers and byte strings (`opkd_mcore.platform.ipc_handles`), checked before anything is mapped.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from opkd_mcore.platform import current_device, is_cpu
from opkd_mcore.platform.ipc_handles import (
    MAX_HANDLES,
    IpcHandleError,
    decode_handles,
    encode_handles,
    export_ipc_handles,
    open_ipc_handle,
    share_buffer,
)
from opkd_mcore.weight_sync.group_transport import StatelessGroupTransport
from opkd_mcore.weight_sync.transport import PendingTransfer, TransportConfig, WeightTransport

# buffer id, byte count, then the sizes of the handle words and bytes that follow (0, 0 = known buffer)
_MSG_WORDS = 4
_MAX_HANDLE_WORDS = MAX_HANDLES * 16
_MAX_HANDLE_BYTES = 16 << 20  # well above 64 receivers' handles; bounds what a bad header makes us allocate


def _sync_device() -> None:
    if not is_cpu():
        torch.accelerator.synchronize()


class _Lazy(PendingTransfer):
    def __init__(self, fn):
        self.fn = fn

    def wait(self, timeout_s: float) -> None:
        self.fn()


class _Lent(PendingTransfer):
    """The next transfer read in place: `landed` is the sender's buffer until `release()`."""

    def __init__(self, transport: "ColocatedIpcTransport", nbytes: int):
        self.transport, self.nbytes = transport, nbytes

    def wait(self, timeout_s: float) -> None:
        self.landed = self.transport._next_shared(self.nbytes)

    def release(self) -> None:
        _sync_device()  # the receiver's reads must be done before the sender refills the buffer
        self.transport._ack()


class ColocatedIpcTransport(WeightTransport):
    """Same interface as the group transport; data never leaves the device."""

    def __init__(self, cfg: TransportConfig, rank: int):
        super().__init__(cfg, rank)
        self.control = StatelessGroupTransport(replace(cfg, device="cpu"), rank)
        self._msg = torch.zeros(_MSG_WORDS, dtype=torch.int64)
        # sender: data_ptr -> (buffer id, the buffer); holding the buffer keeps its address from being
        # reused by a later allocation, which would then pass for an already exported buffer
        self._sent: dict[int, tuple[int, torch.Tensor]] = {}
        self._shared: dict[int, torch.Tensor] = {}  # receiver: buffer id -> the sender's buffer

    def bind(self) -> int:
        """See `StatelessGroupTransport.bind`: the control group's port, held by the sender."""
        port = self.control.bind()
        self.cfg = replace(self.cfg, port=port)
        return port

    def connect(self) -> None:
        self.control.connect()

    def alloc_buffer(self, nbytes: int) -> torch.Tensor:
        return share_buffer(nbytes, current_device(self.cfg.device))

    def _control_bcast(self, t: torch.Tensor) -> None:
        self.control.broadcast(t, t.numel()).wait(self.cfg.timeout_s)

    def _ack(self) -> None:
        self.control.exchange_status("")

    def broadcast(self, buf: torch.Tensor, nbytes: int) -> PendingTransfer:
        if not self.is_sender:
            return _Lazy(lambda: self._receive_into(buf, nbytes))
        words = raw = None
        if buf.data_ptr() not in self._sent:
            self._sent[buf.data_ptr()] = (len(self._sent), buf)
            words, raw = encode_handles(export_ipc_handles(buf, self.world_size - 1))
        _sync_device()  # packing must have landed before a receiver copies
        sizes = [0, 0] if words is None else [words.numel(), raw.numel()]
        self._msg.copy_(torch.tensor([self._sent[buf.data_ptr()][0], nbytes, *sizes]))
        self._control_bcast(self._msg)
        if words is not None:
            self._control_bcast(words)
            if raw.numel():
                self._control_bcast(raw)
        return _Lazy(self._ack)

    @property
    def broadcast_waits(self) -> bool:
        return self.is_sender  # the sender waits for the device, then for the receivers' control message

    @property
    def lends_buffers(self) -> bool:
        return not self.is_sender

    def receive_lent(self, nbytes: int) -> PendingTransfer:
        if self.is_sender:
            raise RuntimeError("receive_lent: the sender has nothing to receive")
        return _Lent(self, nbytes)

    def lent_buffers(self) -> list[torch.Tensor]:
        return list(self._shared.values())

    def _receive_into(self, buf: torch.Tensor, nbytes: int) -> None:
        buf[:nbytes].copy_(self._next_shared(nbytes))
        _sync_device()
        self._ack()

    def _next_shared(self, nbytes: int) -> torch.Tensor:
        """The sender's next message: its buffer's first `nbytes`, mapped (once per buffer) and checked."""
        self._control_bcast(self._msg)
        buf_id, sent_nbytes, num_words, num_bytes = self._msg.tolist()
        what = f"colocated buffer {buf_id} on {self.cfg.host}:{self.cfg.port}"
        if sent_nbytes != nbytes:
            raise RuntimeError(f"{what}: sender moved {sent_nbytes} bytes, receiver expected {nbytes}")
        if num_words:
            self._shared[buf_id] = self._receive_handle(what, num_words, num_bytes)
        shared = self._shared.get(buf_id)
        if shared is None:
            raise IpcHandleError(f"{what}: the sender never sent this buffer's handle "
                                 f"(known buffers: {sorted(self._shared)})")
        if nbytes > shared.numel():
            raise IpcHandleError(f"{what}: {nbytes} bytes announced, the shared buffer holds "
                                 f"{shared.numel()}")
        return shared[:nbytes]

    def _receive_handle(self, what: str, num_words: int, num_bytes: int) -> torch.Tensor:
        if not 0 < num_words <= _MAX_HANDLE_WORDS or not 0 <= num_bytes <= _MAX_HANDLE_BYTES:
            raise IpcHandleError(f"{what}: handle of {num_words} words and {num_bytes} bytes announced, "
                                 f"expected at most {_MAX_HANDLE_WORDS} and {_MAX_HANDLE_BYTES}")
        words = torch.empty(num_words, dtype=torch.int64)
        self._control_bcast(words)
        raw = torch.empty(num_bytes, dtype=torch.uint8)
        if num_bytes:
            self._control_bcast(raw)
        handles = decode_handles(words, raw, what)
        if len(handles) != self.world_size - 1:
            raise IpcHandleError(f"{what}: {len(handles)} handles for {self.world_size - 1} receivers")
        return open_ipc_handle(handles[self.rank - 1], what)

    def exchange_status(self, message: str) -> list[str]:
        return self.control.exchange_status(message)

    def close(self, abort: bool = False) -> None:
        self._shared.clear()
        self._sent.clear()
        self.control.close(abort)
