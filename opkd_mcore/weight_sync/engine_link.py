"""The torchrun (SPMD) layout's weight sync: the trainer rank that owns the vLLM engine drives both ends.

`SpmdWeightSync(MegatronWeightExport(...), handle, rollout)` on every trainer rank; `handle` (the
engine's `VllmReceiverHandle`) and `rollout` (the engine's wrapper, paused while its weights change)
only on the rank that owns the `vllm.LLM`, None on the others. `connect()` starts the rollout
workers' join before the trainer's and awaits both; `sync(version)` pauses the engine, starts the
workers' receive, sends this rank's sources, awaits the receive and stamps the version, so one call
moves the weights end to end. (The Ray controller runs the same two ends in different actors:
`MegatronWeightExport` on the trainer ranks, `VllmReceiverHandle` in each rollout actor.)
"""
from __future__ import annotations

from typing import Protocol

from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport
from opkd_mcore.weight_sync.vllm_handle import VllmReceiverHandle, await_all, run_concurrently


class PausableRollout(Protocol):
    """What the sync needs of the rollout engine's wrapper (`rollout.VllmRollout`)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def set_weight_version(self, version: int, engine_stamped: bool = False) -> None: ...


class SpmdWeightSync:
    """`connect()` once, then `sync(version)` after every optimizer step, `close()` at the end."""

    def __init__(self, export: MegatronWeightExport, handle: VllmReceiverHandle | None = None,
                 rollout: PausableRollout | None = None):
        self.export, self.handle, self.rollout = export, handle, rollout
        self.timeout_s = export.cfg.timeout_s

    def connect(self) -> None:
        """Collective over every trainer rank: stage owners hold their ports first, so the engine
        is only told ports in hand; then both sides join together."""
        groups = self.export.bind()
        if self.handle is None:
            self.export.connect()
            return
        def join():
            return self.handle.join_async(groups, transport=self.export.cfg.transport).result()

        run_concurrently({"rollout workers join": join, "trainer stage owner joins": self.export.connect},
                         self.timeout_s)

    def sync(self, version: int) -> int:
        """Send `version`; on the engine's rank the engine is paused meanwhile, every worker has
        loaded the version when this returns, and the rollout carries it."""
        if self.handle is None:
            self.export.sync(version)
            return version
        if self.rollout is None:
            return self._send_and_receive(version)
        self.rollout.pause()
        try:
            self._send_and_receive(version)  # the engine's own version stamp travels with the receive
            self.rollout.set_weight_version(version, engine_stamped=True)
        finally:
            self.rollout.resume()
        return version

    def _send_and_receive(self, version: int) -> int:
        receiving = self.handle.receive_async(version)  # posted first: it waits for the sender
        self.export.sync(version)
        loaded = await_all({"rollout workers receive": receiving}, self.timeout_s)["rollout workers receive"]
        if set(loaded) != {version}:
            raise RuntimeError(f"weight sync: workers report versions {loaded}, expected {version}")
        return version

    def close(self) -> None:
        """Both ends at once: an accelerator group's teardown waits for every member, so the stage
        owner closing before the engine's workers blocks until a time limit."""
        if self.handle is None:
            self.export.close()
            return
        run_concurrently({"rollout workers leave": self.handle.close,
                          "trainer stage owner leaves": self.export.close}, self.timeout_s)
