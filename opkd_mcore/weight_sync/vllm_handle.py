"""`VllmReceiverHandle`: the driver's handle on a vLLM engine's weight receivers, and concurrent
start of both sides.

Group creation blocks on both sides until the other arrives, so the rollout side's join must
already be posted to the engine before the trainer side joins in the same process, and both must
be awaited. `run_concurrently` does that with one timeout and an error that names the side that
did not finish. Nothing is left un-awaited: a group creation that is not awaited races the other
side, which may try to connect before the sender's store listens.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import uuid
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


def engine_client_posts(llm) -> bool:
    """True when `llm`'s engine core takes posted calls (`post_engine_call`): vLLM's multiprocess
    client; an in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) does not."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return hasattr(client, "utility_results") and hasattr(client, "_send_input")


def post_engine_call(llm, method: str, *args) -> cf.Future:
    """Send one call to `llm`'s engine core from this thread; its future holds the answer.

    vLLM's synchronous client waits for each call's answer before it returns, so a sync took three
    round trips (receive, prefix-cache reset, version stamp), the receive sent by a helper thread
    that the sender's loop kept from the GIL. Posted here, the message is on the wire before the
    sender starts, and calls posted back to back run one after another in the engine core with no
    round trip between them. These are the steps of vLLM's `SyncMPClient.call_utility` (0.26 to
    0.32) without its wait.
    """
    from vllm.v1.engine import EngineCoreRequestType

    if not engine_client_posts(llm):
        raise RuntimeError("post_engine_call: the engine core client takes no posted calls "
                           "(an in-process engine core); use llm.collective_rpc")
    client = llm.llm_engine.engine_core
    call_id = uuid.uuid1().int >> 64
    future: cf.Future = cf.Future()
    client.utility_results[call_id] = future
    client._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
    return future


def _when_all(parts: dict[str, cf.Future], result: Callable[[dict], Any]) -> cf.Future:
    """A future that completes once every part has: `result(answers)`, or the first part's error
    in `parts` order."""
    done: cf.Future = cf.Future()
    left = [len(parts)]
    lock = threading.Lock()

    def finish(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [f.exception() for f in parts.values() if f.exception() is not None]
        if errors:
            done.set_exception(errors[0])
            return
        try:
            done.set_result(result({name: f.result() for name, f in parts.items()}))
        except Exception as err:  # noqa: BLE001  (handed to whoever awaits the sync)
            done.set_exception(err)

    for f in parts.values():
        f.add_done_callback(finish)
    return done


class VllmReceiverHandle:
    """Calls the `VllmWeightReceiver` methods of every worker of one `vllm.LLM`, without blocking.

    Every call is posted (`post_engine_call`) under one lock: vLLM's client socket takes one
    sender at a time, and a call's future is the only thing a thread then waits on."""

    def __init__(self, llm, reset_prefix_cache: bool = True):
        """`reset_prefix_cache`: drop the engine's cached prefixes with every sync; False only
        where every request carries its weight version as `cache_salt` (`VllmRollout` does)."""
        self.llm, self.reset_prefix_cache = llm, reset_prefix_cache
        self.posts = engine_client_posts(llm)
        self._send_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="opkd-vllm-rpc")
        # `time.monotonic()` of the last receive: asked for, sent, and each engine call answered
        self.last_receive_t: dict[str, float] = {}

    def _post(self, calls: dict[str, tuple]) -> dict[str, cf.Future]:
        """Engine-core calls `name -> (method, *args)`, run in order, a future each; an in-process
        engine core (no posted calls) runs them in order on the handle's thread."""
        if not self.posts:
            futures = {name: cf.Future() for name in calls}
            self._pool.submit(self._call_in_order, calls, futures)
            return futures
        with self._send_lock:
            return {name: post_engine_call(self.llm, *call) for name, call in calls.items()}

    def _call_in_order(self, calls: dict[str, tuple], futures: dict[str, cf.Future]) -> None:
        engine = self.llm.llm_engine  # its methods take the engine core's arguments
        for name, (method, *args) in calls.items():
            try:
                futures[name].set_result(getattr(engine, method)(*args))
            except Exception as err:  # noqa: BLE001  (handed to whoever awaits the call)
                futures[name].set_exception(err)

    def _worker_call(self, method: str, *args) -> cf.Future:
        """`collective_rpc(method, args)` on every worker; the future holds their answers."""
        return self._post({"call": ("collective_rpc", method, None, args, None)})["call"]

    def join_async(self, groups: list[TransportConfig], *, rank_offset: int = 1,
                   check_plan: bool = True, transport: str = "group") -> cf.Future:
        """Every worker joins every stage group over `transport` (a name registered in
        `weight_sync.transport`, the same as the sender's); the future holds the group ranks."""
        payload = [asdict(g) for g in groups]
        return self._worker_call("opkd_join_weight_sync", payload, rank_offset, check_plan, transport)

    def receive_async(self, version: int | None = None) -> cf.Future:
        """Every worker receives one sync; the future holds the loaded version per worker.

        With `reset_prefix_cache` the engine core first drops its cached prefixes (their KV was
        computed with the old weights: the engine must be paused, so nothing refills them before
        the new weights are in); it then receives, then takes `version` as vLLM's own stamp
        (metrics, logs) if given.
        """
        t = self.last_receive_t = {"asked": time.monotonic()}
        calls = {"reset": ("reset_prefix_cache", False, False)} if self.reset_prefix_cache else {}
        calls["receive"] = ("collective_rpc", "opkd_receive_weights", None, (), None)
        if version is not None and hasattr(self.llm.llm_engine, "set_weight_version"):
            calls["stamp"] = ("set_weight_version", str(version))
        parts = self._post(calls)
        t["sent"] = time.monotonic()
        for name, f in parts.items():
            f.add_done_callback(lambda _, name=name: t.setdefault(name, time.monotonic()))
        return _when_all(parts, self._received)

    @staticmethod
    def _received(answers: dict[str, Any]) -> list[int]:
        if answers.get("reset") is False:  # vLLM declines while requests hold cached blocks
            raise RuntimeError("weight sync: the engine kept its prefix cache (requests were running); "
                               "pause the engine before a sync")
        return answers["receive"]

    def stats(self) -> list[dict]:
        return self._worker_call("opkd_weight_sync_stats").result()

    def leave(self) -> None:
        """Every worker leaves its groups; the handle stays usable for a later join."""
        self._worker_call("opkd_close_weight_sync").result()

    def close(self) -> None:
        self.leave()
        self._pool.shutdown(wait=True)
