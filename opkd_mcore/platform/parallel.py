"""One entry point that sets up torch.distributed + Megatron's parallel_state on any platform.

`init_parallel(cfg)` picks the device (cuda | npu | cpu), binds this process to its local
accelerator, initialises torch.distributed from `env://` (torchrun, `tests/_dist.py`, or a
one-process group when no launcher set the env) with the matching backend, switches on the
Megatron CPU emulation when the device is the CPU, builds Megatron's TP/PP/VPP/CP/DP/EP groups and
seeds every RNG (Python, numpy, torch and Megatron's model-parallel tracker).
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from opkd_mcore.platform import device as platform_device
from opkd_mcore.platform import megatron_cpu
from opkd_mcore.platform.cpu_rng import seed_cpu_model_parallel
from opkd_mcore.platform.tcp_store import serve_store

logger = logging.getLogger(__name__)


@dataclass
class ParallelConfig:
    """Model-parallel layout of one job; the data-parallel size is what is left of the world."""

    tp: int = 1  # tensor-parallel size (heads and vocab split over this many ranks)
    pp: int = 1  # pipeline-parallel size (layers split into this many stages)
    vpp: int | None = None  # virtual pipeline chunks per stage (interleaved schedule); None = off
    cp: int = 1  # context-parallel size (needs Transformer Engine attention)
    ep: int = 1  # expert-parallel size (MoE families only): routed experts split over this many ranks
    etp: int | None = None  # expert tensor-parallel size (each expert's FFN split); None = tp
    seed: int = 1234  # base seed; TP ranks get seed+2718+tp_rank for model-parallel regions
    timeout_minutes: int = 30  # torch.distributed collective timeout

    def validate(self, world_size: int | None = None) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name}: expected an int >= 1, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"ParallelConfig.etp: expected None or an int >= 1, got {self.etp!r}")
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 1):
            raise ValueError(f"ParallelConfig.vpp: expected None or an int >= 1, got {self.vpp!r}")
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise ValueError(f"ParallelConfig.vpp: interleaving ({self.vpp} chunks) needs pp >= 2, "
                             f"got pp={self.pp}")
        model_parallel = self.tp * self.pp * self.cp
        if world_size is not None and world_size % model_parallel:
            raise ValueError(f"ParallelConfig: world size {world_size} is not divisible by "
                             f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {model_parallel}")
        # Megatron lays the experts out as etp x ep x expert-dp x pp over the same ranks
        expert_parallel = (self.tp if self.etp is None else self.etp) * self.ep * self.pp
        if world_size is not None and world_size % expert_parallel:
            raise ValueError(f"ParallelConfig.ep: world size {world_size} is not divisible by "
                             f"etp*ep*pp = {self.etp or self.tp}*{self.ep}*{self.pp} = {expert_parallel}")


def global_rank() -> int:
    """This process's rank: torch.distributed's once it runs, before that the launcher's RANK."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    return global_rank() == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def bind_local_device(kind: str) -> torch.device:
    """Make this process use its local accelerator (LOCAL_RANK); import torch_npu for NPU."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)
    module = getattr(torch, kind)
    module.set_device(local_rank())
    return torch.device(kind, local_rank())


def _init_process_group(backend: str, timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    timeout = timedelta(minutes=timeout_minutes)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return
    # One rank (a plain `python script.py`, a launcher's single rank, or this process again after an
    # earlier one-rank group was destroyed): nobody joins it, so any port does: the OS picks one for a
    # socket the store takes over (no pick-then-bind race with another process, and never the port of
    # an earlier group's store, which may still be bound), and the store answers on MASTER_ADDR only
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = serve_store(host, 1, timeout)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=host, MASTER_PORT=str(store.port))
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


def _seed_everything(cfg: ParallelConfig, on_cpu: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    random.seed(cfg.seed)
    try:
        import numpy as np

        np.random.seed(cfg.seed)
    except ImportError:
        pass
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    if on_cpu:
        seed_cpu_model_parallel(cfg.seed, tp_rank, ep_rank, etp_rank)
    else:
        torch.manual_seed(cfg.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)


def init_parallel(cfg: ParallelConfig | None = None, device: str | None = None) -> None:
    """Initialise torch.distributed (if needed), the CPU emulation (CPU only), Megatron's groups
    and RNG seeds for the layout `cfg`. Call once per process; `destroy_parallel` undoes it."""
    from megatron.core import parallel_state as ps

    cfg = cfg or ParallelConfig()
    cfg.validate()
    kind = platform_device.device_type(device)
    bind_local_device(kind)
    if kind == "cpu":
        megatron_cpu.enable_cpu_emulation()
    _init_process_group(platform_device.collective_backend(kind), cfg.timeout_minutes)
    cfg.validate(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        raise RuntimeError("init_parallel: Megatron parallel state is already initialised; "
                           "call destroy_parallel() first")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
        distributed_timeout_minutes=cfg.timeout_minutes,
        # Megatron's optimizer asks for the gloo DP groups by default, on every device
        create_gloo_process_groups=True,
    )
    _seed_everything(cfg, on_cpu=kind == "cpu")
    logger.info("parallel initialised: device=%s world=%d tp=%d pp=%d vpp=%s cp=%d ep=%d etp=%s",
                kind, dist.get_world_size(), cfg.tp, cfg.pp, cfg.vpp, cfg.cp, cfg.ep, cfg.etp)


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Tear down Megatron's groups and the CPU emulation; optionally the default process group
    too (leave it to whoever created it, e.g. torchrun scripts pass True)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    megatron_cpu.disable_cpu_emulation()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
