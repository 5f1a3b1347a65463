"""Process groups outside `torch.distributed`'s default group (weight sync between trainer and rollout).

`new_stateless_group` joins `world_size` processes over a TCP store at `host:port` with the backend of
this device (gloo on CPU, nccl on CUDA, hccl on NPU) and returns a `ProcessGroup` whose ranks are
group-local. The default group, if any, is not touched.

gloo and nccl groups are built here from torch alone, so a trainer without vLLM and a vLLM worker
build them the same way (both ends must: the store keys differ between implementations). Other
backends (hccl) go through vLLM's platform layer (vllm-ascend), which knows how to make them.
"""
from __future__ import annotations

import importlib.util
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from opkd_mcore.platform.device import collective_backend

logger = logging.getLogger(__name__)


_TORCH_BUILT = ("gloo", "nccl")
_STORES: dict[int, object] = {}  # id(group) -> its TCP store, which must outlive the group


def _torch_backend(backend: str, store, rank: int, world_size: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout), torch.device("cpu"), \
            dist.ProcessGroup.BackendType.GLOO
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options), torch.device("cuda"), \
            dist.ProcessGroup.BackendType.NCCL
    raise ValueError(f"backend: expected one of {_TORCH_BUILT}, got {backend!r}")


def _torch_stateless_group(host: str, port: int, rank: int, world_size: int, backend: str,
                           timeout: timedelta, join_timeout: timedelta) -> dist.ProcessGroup:
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=join_timeout,
                          wait_for_workers=True)
    store.set_timeout(timeout)
    prefix_store = dist.PrefixStore(f"opkd_stateless/{host}:{port}", store)
    pg = dist.ProcessGroup(prefix_store, rank, world_size)
    backend_obj, device, backend_type = _torch_backend(backend, prefix_store, rank, world_size, timeout)
    pg._set_default_backend(backend_type)
    backend_obj._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, backend_obj)
    _STORES[id(pg)] = store
    return pg


def new_stateless_group(host: str, port: int, rank: int, world_size: int, *,
                        backend: str | None = None, timeout_s: float = 600.0,
                        join_timeout_s: float | None = None) -> dist.ProcessGroup:
    """Join a group of `world_size` processes: blocks until all have joined or `join_timeout_s`
    (default `timeout_s`) passes; collectives on the group then time out after `timeout_s`."""
    backend = backend or collective_backend()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    timeout = timedelta(seconds=timeout_s)
    join_timeout = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
    if backend in _TORCH_BUILT:
        return _torch_stateless_group(host, port, rank, world_size, backend, timeout, join_timeout)
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"backend: a stateless {backend!r} group needs vLLM's platform layer "
                         "(vllm-ascend for hccl); it is not installed")
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend,
                                                          timeout=max(timeout, join_timeout))


def destroy_stateless_group(pg: dist.ProcessGroup) -> None:
    """Release a group made by `new_stateless_group` (idempotent enough for error paths)."""
    try:
        pg.shutdown()
    except (RuntimeError, AttributeError) as err:  # already torn down by a failed peer
        logger.debug("stateless group shutdown: %s", err)
    _STORES.pop(id(pg), None)
