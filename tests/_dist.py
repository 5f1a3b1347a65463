"""Run a function in N real processes joined by a gloo process group (multi-process tests).

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, initialises
`torch.distributed` with gloo on a free localhost port, calls `fn(rank, world_size, *args)` in
each, and returns the list of per-rank return values. An exception on any rank is re-raised in
the parent with that rank's traceback. `fn` must be importable (module-level), since processes
are spawned.
"""
from __future__ import annotations

import os
import pickle
import random
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def launcher_free_env(**extra: str) -> dict:
    """This process's environment without a launcher's rank variables, for a command a test starts
    as a user would from a shell (an in-process `init_parallel` of an earlier test sets them here)."""
    from opkd_mcore.rollout.engine_env import LAUNCHER_VARIABLES

    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}, **extra}


def require_devices(n: int) -> None:
    """Skip a test of `n` ranks on a GPU machine with fewer GPUs (on CPU any number of ranks runs)."""
    import pytest
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port `p` with `p .. p + count - 1` free, below the kernel's ephemeral range: a port the OS
    hands out for `bind(0)` can be taken again by any socket a later process opens (gloo, a TCPStore
    client) before the test binds it, which failed a weight-sync test in CI with EADDRINUSE."""
    rng = random.SystemRandom()
    high = _ephemeral_low() - count
    if high <= 15000:   # an unusual ephemeral range: take what the OS hands out
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        base = rng.randrange(15000, high)
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in [15000, {high + count})")


def _worker(rank, world_size, port, fn, args, env, queue, backend="gloo"):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        if backend is not None:  # None: `fn` initialises the group itself (e.g. nccl via init_parallel)
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=300))
        # pickled by value here: a tensor put on the queue as-is travels as a shared-memory handle
        # that the parent can no longer open once this process has exited (FileNotFoundError)
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, including assertion errors
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, env: dict | None = None, timeout_s: float = 600,
                    backend: str | None = "gloo"):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, env, queue, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
