"""Driver-side handle on a vLLM engine's weight receiver, and concurrent start of both sides.

Group creation blocks on both sides until the other arrives, so the rollout side's
`collective_rpc` must already be running (in a thread) before the trainer side joins in the same
process, and both must be awaited. `run_concurrently` does that with one timeout and an error that
names the side that did not finish (the race described in seed 003 cannot happen: nothing is left
un-awaited).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

from opkd_mcore.weight_sync.transport import TransportConfig, WeightSyncTimeout

RECEIVER_CLS = "opkd_mcore.weight_sync.receiver.VllmWeightReceiver"


def run_concurrently(calls: dict[str, Callable[[], Any]], timeout_s: float) -> dict[str, Any]:
    """Start every call in its own thread, then await all; raises the first error or a timeout."""
    pool = cf.ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="opkd-sync")
    futures = {name: pool.submit(fn) for name, fn in calls.items()}
    try:
        return await_all(futures, timeout_s)
    finally:
        pool.shutdown(wait=False)


def await_all(futures: dict[str, cf.Future], timeout_s: float) -> dict[str, Any]:
    """Wait for named futures; raises WeightSyncTimeout naming the unfinished ones."""
    deadline = time.monotonic() + timeout_s
    done, not_done = cf.wait(list(futures.values()), timeout=timeout_s, return_when=cf.FIRST_EXCEPTION)
    for name, fut in futures.items():
        if fut in done and fut.exception() is not None:
            raise fut.exception()
    if not_done:
        remaining = max(deadline - time.monotonic(), 0)
        _, not_done = cf.wait(not_done, timeout=remaining)
    if not_done:
        names = [n for n, f in futures.items() if f in not_done]
        raise WeightSyncTimeout(f"weight sync: {names} did not finish within {timeout_s:.0f} s")
    return {name: fut.result() for name, fut in futures.items()}


class VllmSyncHandle:
    """Calls the `VllmWeightReceiver` methods of every worker of one `vllm.LLM`, without blocking."""

    SEND_WAIT_S = 1.0  # the longest `receive_async` waits for its RPC thread to run

    def __init__(self, llm):
        self.llm = llm
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="opkd-vllm-rpc")
        # `time.monotonic()` of the last receive: asked for, RPC sent, RPC answered, prefix cache reset
        self.last_receive_t: dict[str, float] = {}

    def join_async(self, groups: list[TransportConfig], *, rank_offset: int = 1,
                   check_plan: bool = True, transport: str = "group") -> cf.Future:
        """Every worker joins every stage group over `transport` (a name registered in
        `weight_sync.transport`, the same as the sender's); the future holds the group ranks."""
        payload = [asdict(g) for g in groups]
        return self._pool.submit(self.llm.collective_rpc, "opkd_join_weight_sync",
                                 args=(payload, rank_offset, check_plan, transport))

    def receive_async(self) -> cf.Future:
        """Every worker receives one sync; the future holds the loaded version per worker."""
        self.last_receive_t = {"asked": time.monotonic()}
        sending = threading.Event()
        future = self._pool.submit(self._receive, sending)
        # the caller's sender loop starts only once the RPC thread runs: started the other way
        # round, the loop's many small tensor ops kept the GIL from that thread, and the engine
        # joined late (on CPU an RPC took 30 ms under such a loop, 1.2 ms with this wait, 0.4 idle)
        sending.wait(self.SEND_WAIT_S)
        return future

    def _receive(self, sending: threading.Event) -> list[int]:
        self.last_receive_t["sent"] = time.monotonic()
        sending.set()
        versions = self.llm.collective_rpc("opkd_receive_weights")
        self.last_receive_t["answered"] = time.monotonic()
        # cached prefixes hold KV computed with the old weights
        self.llm.reset_prefix_cache()
        self.last_receive_t["reset"] = time.monotonic()
        return versions

    def stats(self) -> list[dict]:
        return self._pool.submit(self.llm.collective_rpc, "opkd_weight_sync_stats").result()

    def leave(self) -> None:
        """Every worker leaves its groups; the handle stays usable for a later join."""
        self._pool.submit(self.llm.collective_rpc, "opkd_close_weight_sync").result()

    def close(self) -> None:
        self.leave()
        self._pool.shutdown(wait=True)
