"""Record what a weight load (or pack) does with one bucket, once; replay it as plain copies afterwards.

In vLLM's direct load mode each weight loader copies a slice of the received bucket into a slice of
one of the engine's tensors, and the plan fixes which tensor lands where in which bucket, so every
sync repeats the same copies. The loaders are Python: name mapping, QKV / gate-up stacking, a few
views per tensor, about 50 us of host time per tensor. For a 1.7B model that was ~15 ms per sync
on an H100, more than its device link needs to move the bytes (9 ms), and the engine's device
idles meanwhile.

`CopyRecorder` runs the load once under a dispatch mode that sees every aten op. The record is
usable only if every op that touches the bucket or the model is a view, a same-shape same-dtype
`copy_` from the bucket into the model, or a `fill_` / `zero_` of the model (vocabulary padding).
Anything else (a cast, an index_put, a copy from a temporary) leaves the record unusable, and that
bucket keeps its loader on every sync: nothing is replayed that was not seen to be a pure copy.
`CopyRecord.replay()` then redoes the writes in their order, each run of copies as one
`torch._foreach_copy_`.

The sender's side is the mirror image where the export needs no collective (TP size 1): packing a
bucket copies views of the trainer's parameters into it (`iter_hf_weights(views=True)`), ~47 us of
host time per tensor through the export's Python; replayed, the export is not walked at all.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)
_aten = torch.ops.aten
_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class CopyRecord:
    """The writes of one bucket's load, in order: runs of copies (`dsts[i].copy_(srcs[i])`, one
    `torch._foreach_copy_` per run) and fills between them."""

    steps: list = field(default_factory=list)  # ("copy", dsts, srcs) | ("fill", dst, value)
    impure: str | None = None  # why the record cannot stand in for the load

    def add_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self.steps or self.steps[-1][0] != "copy":
            self.steps.append(("copy", [], []))
        self.steps[-1][1].append(dst)
        self.steps[-1][2].append(src)

    def add_fill(self, dst: torch.Tensor, value: float) -> None:
        self.steps.append(("fill", dst, value))

    def overlapping_copies(self) -> str | None:
        """A run of copies is replayed as one batch, whose order is not guaranteed: two writes of a
        run that may touch the same bytes make the record unusable (judged by their byte extents)."""
        for step in self.steps:
            if step[0] != "copy":
                continue
            spans = sorted(_extent(t) for t in step[1])
            for (ptr_a, _, end_a), (ptr_b, start_b, _) in zip(spans, spans[1:]):
                if ptr_a == ptr_b and start_b < end_a:
                    return "two copies write overlapping bytes"
        return None

    def replay(self) -> None:
        if self.impure is not None:
            raise RuntimeError(f"copy record: not replayable ({self.impure})")
        for kind, dst, arg in self.steps:
            if kind == "copy":
                torch._foreach_copy_(dst, arg)
            else:
                dst.fill_(arg)


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, one past the last byte) that a strided tensor may touch."""
    start = t.storage_offset() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return storage_ptr(t), start, start + (last + 1) * t.element_size()


class CopyRecorder(TorchDispatchMode):
    """`with CopyRecorder(sources, targets) as rec: load(...)`; then `rec.record`. Storage pointers
    of the tensors the work reads from (`sources`) and of those it may write (`targets`): a
    receiver reads the bucket buffer into the model's tensors, a sender the model into the bucket."""

    def __init__(self, sources: set[int], targets: set[int]):
        super().__init__()
        self.sources, self.targets = sources, targets
        self.record = CopyRecord()

    def _touches(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ptr = storage_ptr(t)
        return ptr in self.sources or ptr in self.targets

    def _taint(self, why: str) -> None:
        if self.record.impure is None:
            self.record.impure = why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or self.record.impure is not None:
            return out
        if func is _aten.copy_.default:
            self._copy(*args[:2])
        elif func in _FILLS and storage_ptr(args[0]) in self.targets:
            self.record.add_fill(args[0], float(args[1]) if func is _aten.fill_.Scalar else 0.0)
        elif any(self._touches(a) for a in (*args, *kwargs.values())):
            self._taint(f"{func} on the bucket or the model")
        return out

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if storage_ptr(dst) not in self.targets or storage_ptr(src) not in self.sources:
            if self._touches(dst) or self._touches(src):
                self._taint("a copy that is not source -> target (a temporary in between?)")
            return
        if dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
            self._taint(f"a converting copy ({tuple(src.shape)} {src.dtype} -> "
                        f"{tuple(dst.shape)} {dst.dtype})")
            return
        self.record.add_copy(dst, src)


def model_storages(*modules: torch.nn.Module) -> set[int]:
    """Storage pointers of every parameter and buffer: the tensors a load may write (or a pack read)."""
    return {storage_ptr(t) for _, _, t in _model_tensors(modules) if t.numel() > 0}


def _model_tensors(modules) -> list[tuple[dict, str, torch.Tensor]]:
    """(the dict holding it, its name there, the tensor) for every parameter and buffer: what
    `parameters()` and `buffers()` walk, with where each one sits so that a replacement shows."""
    return [(held, name, t) for root in modules for m in root.modules()
            for held in (m._parameters, m._buffers) for name, t in held.items() if t is not None]


_registrations = 0  # parameters, buffers and submodules registered on any module of this process
_counting = False


def _count_registration(module, name, value) -> None:
    global _registrations
    _registrations += 1  # returns None: the registration itself goes on unchanged


def _count_registrations() -> None:
    global _counting
    if not _counting:
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(_count_registration)
        nn_module.register_module_buffer_registration_hook(_count_registration)
        # a submodule built before the last walk and attached after it registers no tensor now
        nn_module.register_module_module_registration_hook(_count_registration)
        _counting = True


class ModelStorages:
    """`model_storages(*modules)`, walked again only when the model may have changed.

    The walk runs once per weight sync on both ends, to notice tensors that moved (their records
    must go); on the GPU machine it took ~2.1 ms of a 13.6 ms sync for vLLM's Qwen3-1.7B, although
    the model hardly ever changes. Instead `current()` walks again only if a parameter, buffer or
    submodule was registered anywhere since the last walk, or one of the tensors it found is gone,
    no longer where it was found, or has moved (`param.data = ...`). Not seen: a tensor put under a
    new name by writing a module's `_parameters` / `_buffers` / `_modules` dict directly.
    The set returned is shared between calls: do not change it."""

    def __init__(self, *modules: torch.nn.Module):
        _count_registrations()
        self.modules = modules
        self.walks = 0
        self._registrations: int | None = None
        # weak: a tensor the model dropped must not be kept alive (and its memory held) by this list
        self._watch: list[tuple[dict, str, weakref.ref, int]] = []
        self._storages: set[int] = set()

    def current(self) -> set[int]:
        if self._changed():
            self._walk()
        return self._storages

    def _changed(self) -> bool:
        if self._registrations != _registrations:
            return True
        for held, name, ref, ptr in self._watch:
            t = ref()
            # the dict, not only the weak reference: views in the replay records keep a replaced
            # tensor alive, so a `module._parameters[name] = new` would otherwise go unseen
            if t is None or held.get(name) is not t or t.data_ptr() != ptr:
                return True
        return False

    def _walk(self) -> None:
        self._registrations = _registrations  # before: a registration during the walk is seen next time
        found = _model_tensors(self.modules)
        # empty tensors too: one that later gets storage changes the set
        self._watch = [(held, name, weakref.ref(t), t.data_ptr()) for held, name, t in found]
        self._storages = {storage_ptr(t) for _, _, t in found if t.numel() > 0}
        self.walks += 1


def replay_key(digest: str, bucket: int, buf: torch.Tensor) -> tuple:
    """What a record is kept under: the plan, the bucket, and the buffer it was made with."""
    return digest, bucket, buf.data_ptr()


def replay_over(current: BucketReplay | None, storages: set[int], into_model: bool = True) -> BucketReplay:
    """`current` while the model's tensors are where its records point, else a fresh replay (a reload,
    a wake-up or a checkpoint load that reallocated them)."""
    if current is not None and current.model == storages:
        return current
    return BucketReplay(storages, into_model)


class BucketReplay:
    """The first pass over each (plan digest, bucket, buffer) key is recorded; later passes of the same key
    replay the record if it is pure, and do the work again otherwise. `model`: storage pointers of
    the model's tensors; `into_model`: the work copies the buffer into them (a receiver's load),
    else them into the buffer (a sender's pack)."""

    def __init__(self, model: set[int], into_model: bool = True):
        self.model, self.into_model = model, into_model
        self.records: dict[tuple, CopyRecord] = {}

    def replayable(self, key: tuple) -> bool:
        record = self.records.get(key)
        return record is not None and record.impure is None

    def run(self, key: tuple, buf: torch.Tensor, work, may_replay: bool = True) -> bool:
        """Replay `key`'s record (if `may_replay`), or call `work()`, recording it the first time.
        True if replayed."""
        if self.records and next(iter(self.records))[0] != key[0]:
            self.records.clear()  # another plan: its records (and the old buffers they view) go
        if may_replay and self.replayable(key):
            self.records[key].replay()
            return True
        if key in self.records:
            work()
            return False
        ends = ({storage_ptr(buf)}, self.model)
        with CopyRecorder(*(ends if self.into_model else ends[::-1])) as recorder:
            work()
        if recorder.record.impure is None:
            recorder.record.impure = recorder.record.overlapping_copies()
        self.records[key] = recorder.record
        if recorder.record.impure is not None:
            logger.info("weight sync: bucket %s is not replayable (%s)", key[1], recorder.record.impure)
        return False
