"""The environment a vLLM engine inside a `torchrun` job is started with.

torchrun gives each trainer process its rendezvous variables. The engine's own processes inherit
them, and one of them, `TORCHELASTIC_USE_AGENT_STORE`, makes torch's `tcp://` rendezvous connect
to a store that the torchrun agent is supposed to host at the engine's address: nobody does, and
the engine waits there until its timeout (seen on an H200 pair: an `opkd train` TP=2 run stuck in
vLLM's `init_distributed_environment`). The engine is its own job, so it starts without them.
"""
from __future__ import annotations

import contextlib
import os

# set by torchrun / torch elastic for the trainer ranks; none of them describes the engine's job
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                      "MASTER_PORT")


# vLLM's switch between an engine core process of its own (1, its default) and one in the caller's
IN_PROCESS_VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_environment(in_process: bool = False):
    """Within the block (where the engine's processes are started), the launcher's variables are
    unset; they are restored afterwards for the trainer's own process group. `in_process`: the
    engine core is built in this process (vLLM reads the switch while it builds the engine)."""
    names = [n for n in os.environ if n in LAUNCHER_VARIABLES or n.startswith("TORCHELASTIC_")
             or (in_process and n == IN_PROCESS_VARIABLE)]
    saved = {n: os.environ.pop(n) for n in names}
    if in_process:
        os.environ[IN_PROCESS_VARIABLE] = "0"
    try:
        yield
    finally:
        if in_process:
            del os.environ[IN_PROCESS_VARIABLE]
        os.environ.update(saved)


def child_pids() -> set[int]:
    """Every live descendant process of this one."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def yield_cpu_to_trainer(started_before: set[int]) -> None:
    """Lowest CPU priority for the engine processes started since `started_before` (CPU hosts).

    A vLLM worker keeps polling its request queue for a second after each call (a spin with
    `sched_yield`), so on a machine with a few cores an idle engine takes a core from the trainer
    while it trains (seen: two idle engines at 40-56% CPU each during the demo's train stage). At
    the lowest priority the spin only runs on cycles nobody else wants; an engine at work still
    gets the cores the trainer leaves idle while it waits for that engine."""
    import psutil

    for pid in child_pids() - started_before:
        with contextlib.suppress(psutil.Error, OSError):
            psutil.Process(pid).nice(19)
