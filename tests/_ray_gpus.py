"""Ray placement on a CPU machine that declares GPUs: Ray hands their ids to actors exactly as on a GPU
host, so the GPU ids each placement slot gets can be checked without a GPU."""
from __future__ import annotations

import contextlib


class _Probe:
    def gpu_ids(self) -> list[int]:
        import ray

        return sorted(int(i) for i in ray.get_gpu_ids())


@contextlib.contextmanager
def cluster_declaring_gpus(num_gpus: int, num_cpus: int):
    """A local Ray cluster with `num_gpus` declared GPUs (none needed); yields the `ray` module."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def gpus_of(ray, slots, timeout_s: float = 120) -> list[tuple[int, ...]]:
    """The GPU ids an actor placed in each slot gets (one actor per slot, all started at once)."""
    probe = ray.remote(_Probe)
    actors = [probe.options(**slot.actor_options("cuda")).remote() for slot in slots]
    try:
        return [tuple(ids) for ids in ray.get([a.gpu_ids.remote() for a in actors], timeout=timeout_s)]
    finally:
        for actor in actors:
            ray.kill(actor)
