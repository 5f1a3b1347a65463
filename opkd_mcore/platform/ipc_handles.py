"""IPC handles of device buffers as plain fields: numbers and byte strings, never pickled objects.

A colocated weight-sync sender exports the buffers it fills once; the receiver in another process maps
them. torch's own route (`ForkingPickler` + the reducers in `torch/multiprocessing/reductions.py`)
pickles a call to a rebuild function, and unpickling bytes from a socket runs whatever they name. Here
the sender exports the fields those reducers would carry, `encode_handles` packs them into an int64 and
a uint8 tensor that any collective can move, and the receiver checks every length and count before it
maps anything (`decode_handles`, then `open_ipc_handle`).

Kinds (this module is the one place that names devices):
- `shm_file` (CPU, sharing strategy "file_system"): the torch_shm_manager socket path and the shared
  memory object's name, as `rebuild_storage_filename` gets them. The receiver's mapping holds its own
  reference (the segment is ref-counted in place), and the sender keeps its buffer for the transport's
  life, so no extra incref/decref is exchanged.
- `cuda`: the eight fields of `UntypedStorage._share_cuda_()`, rebuilt with `_new_shared_cuda` as
  `rebuild_cuda_tensor` does. `_share_cuda_()` is called once per receiver: each call arms its own
  producer-side reference counter, which that receiver's mapping releases when it is freed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SHM_FILE, CUDA = 1, 2
_NAMES = {SHM_FILE: "shm_file", CUDA: "cuda"}
# kind -> (int fields, byte-string fields); both ends agree on these counts
_LAYOUT = {
    SHM_FILE: (("storage_nbytes", "byte_offset", "numel"), ("manager", "name")),
    CUDA: (("device", "storage_nbytes", "storage_offset_bytes", "ref_counter_offset",
            "event_sync_required", "byte_offset", "numel"), ("handle", "ref_counter", "event_handle")),
}
MAX_HANDLES = 64  # receivers per group
MAX_BLOB_BYTES = 1 << 20  # socket paths, shm names and device handles are far shorter
_TEXT_FIELDS = {("shm_file", "manager"), ("shm_file", "name"), ("cuda", "ref_counter")}  # paths/names


class IpcHandleError(ValueError):
    """Received handle fields that are inconsistent or unsafe to map."""


@dataclass(frozen=True)
class IpcHandleFields:
    """Everything a receiver needs to map one uint8 buffer: a kind code, ints and byte strings."""

    kind: int
    ints: tuple[int, ...]
    blobs: tuple[bytes, ...]

    def field(self, name: str) -> int | bytes:
        int_names, blob_names = _LAYOUT[self.kind]
        if name in int_names:
            return self.ints[int_names.index(name)]
        return self.blobs[blob_names.index(name)]


# ---- sender ------------------------------------------------------------------------------------

def share_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer that `export_ipc_handles` can export (CPU: file_system shared memory)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if buf.device.type == "cpu":
        import torch.multiprocessing as tmp

        tmp.set_sharing_strategy("file_system")
        buf.share_memory_()
    return buf


def export_ipc_handles(buf: torch.Tensor, num_receivers: int) -> list[IpcHandleFields]:
    """One set of fields per receiver for a contiguous 1-D uint8 buffer."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() == 0:
        raise ValueError(f"buf: expected a non-empty contiguous 1-D uint8 tensor, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    storage = buf.untyped_storage()
    placement = (buf.storage_offset(), buf.numel())  # uint8: elements are bytes
    if buf.device.type == "cpu":
        manager, name, size = storage._share_filename_cpu_()
        fields = IpcHandleFields(SHM_FILE, (int(size), *placement), (bytes(manager), bytes(name)))
        return [fields] * num_receivers
    if buf.device.type == "cuda":
        return [_export_cuda(storage, placement) for _ in range(num_receivers)]
    raise ValueError(f"colocated IPC: no handle export for device type {buf.device.type!r}; "
                     "use weight_sync.transport=group")


def _export_cuda(storage: torch.UntypedStorage, placement: tuple[int, int]) -> IpcHandleFields:
    (device, handle, storage_nbytes, storage_offset_bytes, ref_counter, ref_counter_offset,
     event_handle, event_sync_required) = storage._share_cuda_()
    return IpcHandleFields(CUDA, (int(device), int(storage_nbytes), int(storage_offset_bytes),
                                  int(ref_counter_offset), int(bool(event_sync_required)), *placement),
                           (bytes(handle), bytes(ref_counter), bytes(event_handle)))


def encode_handles(handles: list[IpcHandleFields]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 words, uint8 bytes): count, then per handle kind, ints, blob lengths; blobs concatenated."""
    words = [len(handles)]
    for h in handles:
        words += [h.kind, *h.ints, *(len(b) for b in h.blobs)]
    raw = bytearray(b"".join(b for h in handles for b in h.blobs))
    blob = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return torch.tensor(words, dtype=torch.int64), blob


# ---- receiver ----------------------------------------------------------------------------------

def decode_handles(words: torch.Tensor, raw: torch.Tensor, what: str) -> list[IpcHandleFields]:
    """Parse `encode_handles` output, checking every count and length; errors name `what`."""
    w = words.tolist()
    if not w or not 1 <= w[0] <= MAX_HANDLES:
        raise IpcHandleError(f"{what}: expected 1..{MAX_HANDLES} handles, header says {w[:1]}")
    data, pos, at, out = raw.cpu().numpy().tobytes(), 1, 0, []
    for i in range(w[0]):
        kind = w[pos] if pos < len(w) else None
        if kind not in _LAYOUT:
            raise IpcHandleError(f"{what}: handle {i} has kind {kind}, expected one of {sorted(_NAMES)}")
        n_ints, n_blobs = (len(names) for names in _LAYOUT[kind])
        fields = w[pos + 1:pos + 1 + n_ints + n_blobs]
        if len(fields) != n_ints + n_blobs:
            raise IpcHandleError(f"{what}: handle {i} ({_NAMES[kind]}) is cut short: expected "
                                 f"{n_ints + n_blobs} fields, got {len(fields)}")
        ints, lengths = tuple(fields[:n_ints]), fields[n_ints:]
        if any(v < 0 for v in ints) or any(not 0 < n <= MAX_BLOB_BYTES for n in lengths):
            raise IpcHandleError(f"{what}: handle {i} ({_NAMES[kind]}) has negative numbers {ints} or "
                                 f"byte strings outside 1..{MAX_BLOB_BYTES} bytes: {lengths}")
        if at + sum(lengths) > len(data):
            raise IpcHandleError(f"{what}: handle {i} needs {at + sum(lengths)} bytes of strings, "
                                 f"{len(data)} were sent")
        blobs = []
        for n in lengths:
            blobs.append(data[at:at + n])
            at += n
        out.append(_checked(IpcHandleFields(kind, ints, tuple(blobs)), f"{what}, handle {i}"))
        pos += 1 + n_ints + n_blobs
    if pos != len(w) or at != len(data):
        raise IpcHandleError(f"{what}: {len(w) - pos} words and {len(data) - at} bytes left over after "
                             f"{w[0]} handles")
    return out


def _checked(h: IpcHandleFields, what: str) -> IpcHandleFields:
    kind = _NAMES[h.kind]
    _, blob_names = _LAYOUT[h.kind]
    for name, blob in zip(blob_names, h.blobs):
        if (kind, name) in _TEXT_FIELDS:
            _text(blob, f"{what}: {name}")
    if h.kind == SHM_FILE:
        name = h.field("name").decode()
        if not name.startswith("/") or "/" in name[1:]:
            raise IpcHandleError(f"{what}: shared-memory name {name!r} is not of the form /NAME")
    if h.field("numel") < 1 or h.field("byte_offset") + h.field("numel") > h.field("storage_nbytes"):
        raise IpcHandleError(f"{what}: bytes [{h.field('byte_offset')}, +{h.field('numel')}) do not fit "
                             f"the shared storage of {h.field('storage_nbytes')} bytes")
    return h


def _text(blob: bytes, what: str) -> str:
    try:
        text = blob.decode("ascii")
    except UnicodeDecodeError as err:
        raise IpcHandleError(f"{what}: expected printable ASCII, got {blob[:32]!r}") from err
    if not text.isprintable():
        raise IpcHandleError(f"{what}: expected printable ASCII, got {text[:32]!r}")
    return text


def open_ipc_handle(h: IpcHandleFields, what: str, peer: bool = False) -> torch.Tensor:
    """Map the sender's buffer described by checked fields; a uint8 view of its bytes.

    `peer`: map a device buffer into this process's current device through peer access (the
    tensor is labelled with that device; its bytes stay on the sender's), so kernels of this
    device write it over the interconnect; no context is created on the sender's device. The
    sender's buffer must not be in use when it is mapped (its stream is not waited for)."""
    try:
        if h.kind == SHM_FILE:
            storage = torch.UntypedStorage._new_shared_filename_cpu(
                h.field("manager"), h.field("name"), h.field("storage_nbytes"))
        else:
            storage = _open_cuda(h, what, peer)
    except RuntimeError as err:  # gone segment, foreign handle, wrong device: say which buffer
        raise IpcHandleError(f"{what}: could not map the sender's {_NAMES[h.kind]} buffer ({err})") from err
    if storage.nbytes() != h.field("storage_nbytes"):
        raise IpcHandleError(f"{what}: mapped {storage.nbytes()} bytes, the sender announced "
                             f"{h.field('storage_nbytes')}")
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, h.field("byte_offset"), (h.field("numel"),))


def _open_cuda(h: IpcHandleFields, what: str, peer: bool = False) -> torch.UntypedStorage:
    torch.cuda._lazy_init()
    device = torch.cuda.current_device() if peer else h.field("device")
    if device >= torch.cuda.device_count():
        raise IpcHandleError(f"{what}: device {device} does not exist here "
                             f"({torch.cuda.device_count()} visible)")
    return torch.UntypedStorage._new_shared_cuda(
        device, h.field("handle"), h.field("storage_nbytes"), h.field("storage_offset_bytes"),
        h.field("ref_counter"), h.field("ref_counter_offset"), h.field("event_handle"),
        bool(h.field("event_sync_required")) and not peer)
