"""A trainer process that also drives the vLLM engine (CPU demo, single node): both ends in one call.

`EngineWeightSync(MegatronWeightSync(...), VllmSyncHandle(llm))` on the rank that owns the `vllm.LLM`
(pass `handle=None` on the other trainer ranks). `connect()` starts the rollout workers' join
before the trainer's and awaits both; `sync(version)` starts the workers' receive, sends this
rank's stage and awaits the receive, so one call moves the weights end to end.
"""
from __future__ import annotations

from opkd_mcore.weight_sync.megatron_source import MegatronWeightSync
from opkd_mcore.weight_sync.vllm_handle import VllmSyncHandle, await_all, run_concurrently


class EngineWeightSync:
    """`connect()` once, then `sync(version)` after every optimizer step."""

    def __init__(self, source: MegatronWeightSync, handle: VllmSyncHandle | None):
        self.source, self.handle = source, handle
        self.timeout_s = source.cfg.timeout_s

    def connect(self) -> None:
        """Collective over every trainer rank: stage owners hold their ports first, so the engine
        is only told ports in hand; then both sides join together."""
        groups = self.source.bind()
        if self.handle is None:
            self.source.connect()
            return
        join = lambda: self.handle.join_async(groups, transport=self.source.cfg.transport).result()  # noqa: E731
        run_concurrently({"rollout workers join": join, "trainer stage owner joins": self.source.connect},
                         self.timeout_s)

    def sync(self, version: int) -> int:
        """Send `version`; on the engine's rank also wait until every worker has loaded it."""
        if self.handle is None:
            self.source.sync(version)
            return version
        receiving = self.handle.receive_async(version)  # posted first: it waits for the sender
        self.source.sync(version)
        loaded = await_all({"rollout workers receive": receiving}, self.timeout_s)["rollout workers receive"]
        if set(loaded) != {version}:
            raise RuntimeError(f"weight sync: workers report versions {loaded}, expected {version}")
        return version

    def close(self) -> None:
        """Both ends at once: an accelerator group's teardown waits for every member, so the stage
        owner closing before the engine's workers (as this did) blocked until a time limit."""
        if self.handle is None:
            self.source.close()
            return
        run_concurrently({"rollout workers leave": self.handle.close,
                          "trainer stage owner leaves": self.source.close}, self.timeout_s)
