"""Data-parallel rollout: one `VllmRollout` engine per Ray actor, prompts split between them.

The group behaves like one engine: `generate` returns samples prompt-major with `group_id` the
prompt's index in the whole batch, and `pause` / `resume` / `set_weight_version` reach every
engine, so all samples of a call carry one weight version.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from opkd_mcore import platform
from opkd_mcore.rollout.config import RolloutConfig, SamplingConfig
from opkd_mcore.rollout.sample import Sample
from opkd_mcore.rollout.vllm_rollout import VllmRollout

logger = logging.getLogger(__name__)


class RolloutWorker:
    """Body of one rollout actor (wrapped with `ray.remote` by `RayRolloutGroup`)."""

    def __init__(self, model_dir: str, cfg: RolloutConfig, worker_extension_cls: str | None):
        self.engine = VllmRollout(model_dir, cfg, worker_extension_cls)

    def generate(self, prompts, sampling: SamplingConfig, data) -> list[Sample]:
        return self.engine.generate(prompts, sampling, data)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def set_weight_version(self, version: int) -> int:
        self.engine.set_weight_version(version)
        return self.engine.weight_version

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """Reach the vLLM workers of this engine (e.g. the weight receiver extension)."""
        return self.engine.llm.collective_rpc(method, args=args, kwargs=kwargs)

    def shutdown(self) -> None:
        self.engine.shutdown()


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, end) ranges covering range(n), sizes differing by at most 1."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class RayRolloutGroup:
    """`num_engines` rollout actors on the local/attached Ray cluster.

    Args:
        model_dir: student checkpoint every engine starts from.
        cfg: engine settings (each engine may itself be TP-sharded: `cfg.tensor_parallel_size`).
        num_engines: data-parallel engines.
        worker_extension_cls: dotted path mixed into the vLLM workers (weight receive).
        num_cpus_per_engine: Ray CPUs reserved per actor.
    """

    def __init__(self, model_dir: str, cfg: RolloutConfig | None = None, num_engines: int = 1, *,
                 worker_extension_cls: str | None = None, num_cpus_per_engine: float = 1):
        import ray

        if num_engines < 1:
            raise ValueError(f"num_engines: expected >= 1, got {num_engines}")
        cfg = cfg or RolloutConfig()
        cfg.validate()
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        # accelerators per engine = its TP size; on a CPU host Ray reserves only CPUs
        accelerators = 0 if platform.is_cpu() else cfg.tensor_parallel_size
        actor = ray.remote(num_cpus=num_cpus_per_engine, num_gpus=accelerators)(RolloutWorker)
        self.workers = [actor.remote(model_dir, cfg, worker_extension_cls) for _ in range(num_engines)]
        self._version = 0

    def _all(self, method: str, *args) -> list:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence, sampling: SamplingConfig | None = None,
                 data: Sequence[dict] | None = None) -> list[Sample]:
        import ray

        sampling = sampling or SamplingConfig()
        if data is not None and len(data) != len(prompts):
            raise ValueError(f"data: expected one dict per prompt ({len(prompts)}), got {len(data)}")
        shards = [(s, e) for s, e in split_evenly(len(prompts), len(self.workers)) if e > s]
        refs = [w.generate.remote(list(prompts[s:e]), sampling, None if data is None else list(data[s:e]))
                for w, (s, e) in zip(self.workers, shards)]
        samples = []
        for (start, _), part in zip(shards, ray.get(refs)):
            for sample in part:
                sample.group_id += start  # index of the prompt in the whole batch
            samples += part
        return samples

    def pause(self) -> None:
        self._all("pause")

    def resume(self) -> None:
        self._all("resume")

    def set_weight_version(self, version: int) -> None:
        self._all("set_weight_version", version)
        self._version = version

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """`collective_rpc` on every engine; one list of worker results per engine."""
        return self._all("collective_rpc", method, args, kwargs)

    def shutdown(self) -> None:
        import ray

        try:
            self._all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
