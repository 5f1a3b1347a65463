"""Colocated transport: trainer and rollout worker share a device; bytes move by IPC handles.

The sender's two bucket buffers (and the small header/plan buffers) are exported once as IPC
handles (torch's multiprocessing reducers, through `ForkingPickler`); afterwards each transfer is a short
control message (buffer id, byte count) over a CPU gloo group, a device-to-device copy on the
receiver into its own reused buffer, and an acknowledgement. The sender waits for the
acknowledgement before it reuses a buffer, so a buffer is never overwritten while a receiver still
reads it. On accelerators the handles are device IPC handles; on CPU the buffers live in shared
memory (sharing strategy "file_system"), which is how this path is tested on a CPU-only machine.
"""
from __future__ import annotations

import pickle
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp

from opkd_mcore.platform import current_device, is_cpu
from opkd_mcore.weight_sync.group_transport import StatelessGroupTransport
from opkd_mcore.weight_sync.transport import PendingTransfer, TransportConfig, WeightTransport

_MSG_WORDS = 3  # buffer id, byte count, length of a pickled handle that follows (0 = known buffer)


def _sync_device() -> None:
    if not is_cpu():
        torch.accelerator.synchronize()


class _Lazy(PendingTransfer):
    def __init__(self, fn):
        self.fn = fn

    def wait(self, timeout_s: float) -> None:
        self.fn()


class ColocatedIpcTransport(WeightTransport):
    """Same interface as the group transport; data never leaves the device."""

    def __init__(self, cfg: TransportConfig, rank: int):
        super().__init__(cfg, rank)
        self.control = StatelessGroupTransport(replace(cfg, device="cpu"), rank)
        self._msg = torch.zeros(_MSG_WORDS, dtype=torch.int64)
        self._sent_ids: dict[int, int] = {}  # sender: data_ptr -> buffer id
        self._shared: dict[int, torch.Tensor] = {}  # receiver: buffer id -> the sender's buffer

    def connect(self) -> None:
        self.control.connect()

    def alloc_buffer(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=current_device(self.cfg.device))
        if buf.device.type == "cpu":
            tmp.set_sharing_strategy("file_system")
            buf.share_memory_()
        return buf

    def _control_bcast(self, t: torch.Tensor) -> None:
        self.control.broadcast(t, t.numel()).wait(self.cfg.timeout_s)

    def _ack(self) -> None:
        self.control.exchange_status("")

    def broadcast(self, buf: torch.Tensor, nbytes: int) -> PendingTransfer:
        if not self.is_sender:
            return _Lazy(lambda: self._receive_into(buf, nbytes))
        handle = b""
        if buf.data_ptr() not in self._sent_ids:
            self._sent_ids[buf.data_ptr()] = len(self._sent_ids)
            handle = bytes(ForkingPickler.dumps(buf))  # torch registers its IPC reducers here
        _sync_device()  # packing must have landed before a receiver copies
        self._msg.copy_(torch.tensor([self._sent_ids[buf.data_ptr()], nbytes, len(handle)]))
        self._control_bcast(self._msg)
        if handle:
            self._control_bcast(torch.frombuffer(bytearray(handle), dtype=torch.uint8))
        return _Lazy(self._ack)

    def _receive_into(self, buf: torch.Tensor, nbytes: int) -> None:
        self._control_bcast(self._msg)
        buf_id, sent_nbytes, handle_len = self._msg.tolist()
        if sent_nbytes != nbytes:
            raise RuntimeError(f"colocated transfer: sender moved {sent_nbytes} bytes, receiver expected {nbytes}")
        if handle_len:
            raw = torch.empty(handle_len, dtype=torch.uint8)
            self._control_bcast(raw)
            self._shared[buf_id] = pickle.loads(raw.numpy().tobytes())
        buf[:nbytes].copy_(self._shared[buf_id][:nbytes])
        _sync_device()
        self._ack()

    def exchange_status(self, message: str) -> list[str]:
        return self.control.exchange_status(message)

    def close(self) -> None:
        self._shared.clear()
        self.control.close()
