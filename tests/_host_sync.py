"""`SyncingOpRecorder`: the ops that would make the host wait for an accelerator, recorded on CPU.

On CPU every op runs synchronously, so tests check what the ops are: no tensor built from Python
data (`aten.lift_fresh` of more than a scalar: a list index or `torch.tensor(...)`, copied to the
device by a blocking copy), no `.item()` (`_local_scalar_dense`), no `nonzero` (a data-dependent
shape), no copy to or from another device. Python scalars (0-dim, passed by value) are allowed.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = ("aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero", "aten.item")


class SyncingOpRecorder(TorchDispatchMode):
    """Records every op that would block the host on an accelerator."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("aten.lift_fresh") and args[0].dim() == 0:
            pass   # a Python scalar (`z[:, a:] = -1e4`): a wrapped number, passed by value, no copy
        elif name.startswith(SYNCING_OPS):
            self.seen.append(name)
        elif name.startswith("aten._to_copy") and "device" in kwargs and kwargs["device"] != args[0].device:
            self.seen.append(f"{name} to {kwargs['device']}")
        return func(*args, **kwargs)
