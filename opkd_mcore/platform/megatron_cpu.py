"""Megatron-core on a CPU-only torch: the emulation layer (switched on by `init_parallel` on CPU).

Megatron assumes CUDA everywhere: ~175 calls to `torch.cuda.current_device()` pick allocation
devices, some code passes `device='cuda'` literally, modules call `torch.cuda.synchronize()`,
streams, events and NVTX ranges, and the RNG tracker forks CUDA generator states. On a CPU build
of torch every one of those raises. Instead of patching Megatron's files, this module

* swaps a handful of `torch.cuda` functions for CPU stand-ins (saved and restored on disable),
* pushes a `TorchFunctionMode` that rewrites any CUDA `device=` argument (and `Tensor.cuda()`,
  `Tensor.to('cuda')`, `pin_memory=True`) to the CPU,
* installs an RNG tracker that forks the CPU generator, so Megatron's
  `get_cuda_rng_tracker().fork()` (weight init, dropout in TP regions) works unchanged,
* runs the Python backward of custom autograd Functions under the same mode (see
  `_backward_with_mode`),
* hands `all_to_all_single` its split sizes as lists: the MoE all-to-all token dispatcher moves
  them to the host with a helper that only converts CUDA tensors (to numpy), so on the CPU they
  arrive as tensors, which the collective's signature refuses,
* gathers tensors of different sizes (`all_gather` into a list of uneven shards) by padding them
  to the largest: gloo refuses uneven shards, which the MoE all-to-all dispatcher gathers over
  the expert-TP group when those ranks hold different tokens (expert TP at TP=1).

Everything is reversible (`disable_cpu_emulation`) and never active on GPU/NPU.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

from opkd_mcore.platform import cpu_rng

logger = logging.getLogger(__name__)

_ACCEL_TYPE = "cuda"  # the device type Megatron hard-codes; rewritten to the CPU here
_CPU = torch.device("cpu")
_lock = threading.Lock()
_state: dict = {"enabled": False, "saved": {}, "mode": None, "rng": None}


def _is_accel_device(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):  # torch.cuda.current_device() style ordinal
        return True
    if isinstance(value, str):
        return value.split(":")[0] == _ACCEL_TYPE
    if isinstance(value, torch.device):
        return value.type == _ACCEL_TYPE
    return False


_TENSOR_TO_ACCEL = {torch.Tensor.cuda}
_TENSOR_TO = {torch.Tensor.to}
_DEVICE_KWARGS = ("device",)
_SPLIT_KWARGS = ("output_split_sizes", "input_split_sizes")


def _is_collective(func, name: str) -> bool:
    # torch.distributed wraps its collectives (c10d_logger), so compare by name, not identity
    return getattr(func, "__name__", "") == name and \
        getattr(func, "__module__", "").startswith("torch.distributed")


def _all_gather_uneven(func, args, kwargs):
    """`all_gather(tensor_list, tensor, group=...)` for shards of different sizes: gather them
    padded to the largest and copy each rank's rows into its entry (the NCCL call does the same
    without padding). Equal shards go straight to the collective."""
    tensor_list, tensor, rest = args[0], args[1], args[2:]
    sizes = [t.numel() for t in tensor_list]
    if len(set(sizes)) == 1 or kwargs.get("async_op"):
        return func(*args, **kwargs)
    padded = tensor.new_zeros(max(sizes))
    padded[:tensor.numel()] = tensor.reshape(-1)
    gathered = [torch.empty_like(padded) for _ in tensor_list]
    func(gathered, padded, *rest, **kwargs)
    for out, got in zip(tensor_list, gathered):
        out.copy_(got[:out.numel()].view_as(out))
    return None


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU (the emulation's core)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _TENSOR_TO_ACCEL:
            return args[0].to(_CPU)
        for key in _DEVICE_KWARGS:
            if key in kwargs and _is_accel_device(kwargs[key]):
                kwargs[key] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA runtime
        if func in _TENSOR_TO and len(args) > 1 and _is_accel_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if _is_collective(func, "all_gather") and len(args) >= 2 and isinstance(args[0], list):
            return _all_gather_uneven(func, args, kwargs)
        if _is_collective(func, "all_to_all_single"):
            for key in _SPLIT_KWARGS:
                if isinstance(kwargs.get(key), torch.Tensor):
                    kwargs[key] = kwargs[key].tolist()
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers accept only 'torch.cuda.*Tensor' type strings (distributed
            # optimizer, bf16 optimizer, grad clipping): report CPU tensors under those names
            name = func(*args)
            if args[0].device.type != "cpu":
                return name
            return name.replace("torch.", f"torch.{_ACCEL_TYPE}.", 1)
        return func(*args, **kwargs)


def _backward_with_mode(original_apply):
    """`BackwardCFunction.apply` (a custom autograd Function's backward) that enters a
    `CpuDeviceMode` when none is on. `torch.autograd.backward` dispatches through the mode, and a
    mode is off while its own handler runs, so without this the Python backward of Megatron's
    Functions (the MoE all-to-all allocates on `torch.cuda.current_device()`) would see raw CUDA
    device arguments."""

    def apply(self, *args):
        from torch.overrides import _get_current_function_mode_stack

        if any(isinstance(m, CpuDeviceMode) for m in _get_current_function_mode_stack()):
            return original_apply(self, *args)
        with CpuDeviceMode():
            return original_apply(self, *args)

    return apply


class _CpuStream:
    """Stand-in for `torch.cuda.Stream`: CPU work is synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuEvent:
    """Stand-in for `torch.cuda.Event`: records wall time so `elapsed_time` stays meaningful."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return (end._t - self._t) * 1000.0


def _noop(name: str):
    """A distinct do-nothing function per bridged name: torch._dynamo indexes torch functions by
    identity and refuses one object registered under two names with different trace rules."""

    def noop(*args, **kwargs):
        return None

    noop.__name__ = noop.__qualname__ = name
    return noop


def _bridges() -> dict:
    """`torch.cuda` attributes replaced while the emulation is on (name -> CPU stand-in)."""
    return {
        "current_device": lambda: 0,
        "synchronize": _noop("synchronize"),
        "current_stream": lambda *a, **k: _CpuStream(),
        "default_stream": lambda *a, **k: _CpuStream(),
        "Stream": _CpuStream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "set_stream": _noop("set_stream"),
        "Event": _CpuEvent,
        "set_device": _noop("set_device"),
        "empty_cache": _noop("empty_cache"),
    }


def _nvtx_bridges() -> dict:
    return {"range_push": _noop("range_push"), "range_pop": _noop("range_pop"), "mark": _noop("mark"),
            "range": lambda *a, **k: contextlib.nullcontext()}


def _thread_run_with_mode(original_run):
    """`Thread.run` that enters a `CpuDeviceMode` first: torch function modes are thread-local,
    so without this, Megatron code run from a worker thread would see raw CUDA device arguments."""

    def run(self):
        with CpuDeviceMode():
            return original_run(self)

    return run


def _swap(namespace, replacements: dict, saved: dict, prefix: str) -> None:
    for name, value in replacements.items():
        saved[(prefix, name)] = (namespace, getattr(namespace, name, None))
        setattr(namespace, name, value)


def is_enabled() -> bool:
    """True while the CPU emulation is switched on in this process."""
    return _state["enabled"]


def enable_cpu_emulation() -> None:
    """Switch the emulation on (idempotent). Only `init_parallel` on CPU should call this."""
    with _lock:
        if _state["enabled"]:
            return
        if torch.cuda.is_available():
            # e.g. checkpoint conversion asked to run on the CPU of a GPU machine
            logger.warning("Megatron CPU emulation enabled although a CUDA device is present")
        saved: dict = {}
        _swap(torch.cuda, _bridges(), saved, "cuda")
        _swap(torch.cuda.nvtx, _nvtx_bridges(), saved, "nvtx")
        _swap(threading.Thread, {"run": _thread_run_with_mode(threading.Thread.run)}, saved, "thread")
        backward_cls = torch.autograd.function.BackwardCFunction
        _swap(backward_cls, {"apply": _backward_with_mode(backward_cls.apply)}, saved, "autograd")

        _state["rng"] = cpu_rng.install_cpu_rng(saved)
        mode = CpuDeviceMode()
        mode.__enter__()
        _state.update(enabled=True, saved=saved, mode=mode)
        logger.info("Megatron CPU emulation enabled")


def disable_cpu_emulation() -> None:
    """Undo `enable_cpu_emulation`: restore every swapped attribute and pop the device mode."""
    with _lock:
        if not _state["enabled"]:
            return
        _state["mode"].__exit__(None, None, None)
        for (_, name), (namespace, original) in _state["saved"].items():
            setattr(namespace, name, original)
        _state.update(enabled=False, saved={}, mode=None, rng=None)
        logger.info("Megatron CPU emulation disabled")
