"""The torch profiler over one training step, with the activities of this process's device.

On an accelerator the trace holds its kernels as well as the host's operators; the summary table is
sorted by device time there (what the GPU spends) and by host time on CPU. NPUs profile through
`torch_npu.profiler`, which is not wired here: asking for a profile there is an error, not a trace
without the device.
"""
from __future__ import annotations

import contextlib
import os

from torch.profiler import ProfilerActivity, profile

from opkd_mcore.platform.device import device_type

_ROWS = 40  # operators in the summary table


def _activities() -> tuple[list[ProfilerActivity], str]:
    kind = device_type()
    if kind == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA], "self_cuda_time_total"
    if kind == "cpu":
        return [ProfilerActivity.CPU], "self_cpu_time_total"
    raise RuntimeError(f"logging.profile_steps: the torch profiler does not see {kind} kernels; "
                       f"profile with the device vendor's profiler instead")


@contextlib.contextmanager
def profiled(path_prefix: str, trace: bool = True):
    """Profile the block; write `<path_prefix>.txt` (the operators by self time on the device, or on
    the host on CPU) and, with `trace`, `<path_prefix>.json` (Chrome / Perfetto trace)."""
    activities, sort_by = _activities()
    os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    if trace:
        prof.export_chrome_trace(f"{path_prefix}.json")
    with open(f"{path_prefix}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=sort_by, row_limit=_ROWS))
        f.write("\n")
