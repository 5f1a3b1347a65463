"""Where the worker groups run: Ray placement groups for the trainer, rollout and teacher actors.

    disaggregated (controller.placement: disaggregated)       colocated (placement: colocated)
      trainer pool   [rank 0][rank 1] ...   1 device each       shared pool, one bundle per trainer rank:
      rollout pool   [engine 0][engine 1]   rollout_tp each       [rank 0 + engine 0 + teacher a]
      teacher pool   [teacher a][teacher b] 1 each (remote: 0)    [rank 1 + engine 1 + teacher b] ...
      (teachers_with_rollout: [engine 0 + teacher a] ...)         actors of a bundle split its device

Each pool is one placement group (PACK: one node when it fits, spread over nodes when not), so a
multi-node cluster gets the trainer ranks together and the engines wherever devices are free. A
pool that the cluster cannot hold is an error naming the pool, its bundles and what the cluster has.
Accelerator names come from `opkd_mcore.platform` (CPU bundles reserve CPUs only).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opkd_mcore.config.placement_rules import colocated_bundles, teacher_actor_endpoints
from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.platform.ray_resources import ray_accelerator_resource, ray_actor_resources

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """One actor's place: a bundle of a placement group and its share of that bundle."""

    pg: PlacementGroup
    bundle: int
    cpus: float
    accelerators: float  # devices (or a fraction of one, when colocated)

    def actor_options(self, device: str | None) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.cpus, **ray_actor_resources(device, self.accelerators),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=self.bundle)}


def _wait_ready(pg, name: str, bundles: list[dict], timeout_s: float) -> None:
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"controller: the {name} pool ({len(bundles)} bundles, e.g. {bundles[0]}) could "
                           f"not be placed within {timeout_s:.0f} s; the cluster has "
                           f"{ray.cluster_resources()} (lower controller.cpus_per_worker or the "
                           "number of workers, or add nodes)") from None


class Placement:
    """The placement groups of one run and a `Slot` per actor."""

    def __init__(self, cfg: TrainConfig, world_size: int, timeout_s: float = 300.0):
        from ray.util.placement_group import placement_group

        ctl = cfg.controller
        self.device = cfg.run.device
        self.kind = ctl.placement
        self.groups: list = []
        cpus = ctl.cpus_per_worker
        teachers = teacher_actor_endpoints(cfg)
        teacher_devices = [0.0 if t.backend == "remote" else 1.0 for t, _ in teachers]
        accel = ray_accelerator_resource(self.device)

        def bundle(cpu: float, devices: float) -> dict:
            return {"CPU": cpu, **({accel: devices} if accel and devices else {})}

        def pool(name: str, bundles: list[dict]):
            pg = placement_group(bundles, strategy="PACK", name=f"opkd-{name}")
            _wait_ready(pg, name, bundles, timeout_s)
            self.groups.append(pg)
            return pg

        if self.kind == "disaggregated":
            pg = pool("trainer", [bundle(cpus, 1)] * world_size)
            self.trainer = [Slot(pg, i, cpus, 1) for i in range(world_size)]
            if ctl.teachers_with_rollout:  # engine e's device also holds teachers e, e + engines, ...
                engines = ctl.rollout_engines
                mine = [[i for i in range(len(teachers)) if i % engines == e] for e in range(engines)]
                sharing = [1 + sum(1 for i in m if teacher_devices[i]) for m in mine]  # actors on the device
                pg = pool("rollout", [bundle(cpus * (1 + len(m)), 1) for m in mine])
                self.rollout = [Slot(pg, e, cpus, 1.0 / sharing[e]) for e in range(engines)]
                self.teachers = [Slot(pg, i % engines, cpus, d / sharing[i % engines])
                                 for i, d in enumerate(teacher_devices)]
                return
            pg = pool("rollout", [bundle(cpus, ctl.rollout_tp)] * ctl.rollout_engines)
            self.rollout = [Slot(pg, i, cpus, ctl.rollout_tp) for i in range(ctl.rollout_engines)]
            self.teachers = []
            if teachers:
                pg = pool("teacher", [bundle(cpus, d) for d in teacher_devices])
                self.teachers = [Slot(pg, i, cpus, d) for i, d in enumerate(teacher_devices)]
            return
        if accel is not None and ctl.rollout_tp != 1:
            raise ValueError(f"controller.rollout_tp: colocated engines take one trainer device each (an "
                             f"engine of {ctl.rollout_tp} devices would span several bundles); use 1, or "
                             "placement: disaggregated")
        # colocated: one bundle per trainer rank; engines and teachers share bundles round-robin
        engine_at, teacher_at = colocated_bundles(cfg, world_size)
        members = [["trainer"] for _ in range(world_size)]
        for b in engine_at:
            members[b].append("rollout")
        for b, devices in zip(teacher_at, teacher_devices):
            members[b].append("teacher" if devices else "teacher-remote")
        shares = [1.0 / sum(m != "teacher-remote" for m in ms) for ms in members]
        pg = pool("shared", [bundle(cpus * len(ms), 1) for ms in members])
        self.trainer = [Slot(pg, i, cpus, shares[i]) for i in range(world_size)]
        self.rollout = [Slot(pg, b, cpus, shares[b]) for b in engine_at]
        self.teachers = [Slot(pg, b, cpus, shares[b] if d else 0.0)
                         for b, d in zip(teacher_at, teacher_devices)]

    def shared_device(self, slot: Slot) -> tuple | None:
        """The device `slot` shares with other actors' slots, as (placement group, bundle), or None
        when it has a device of its own or none (CPU, a remote teacher)."""
        if ray_accelerator_resource(self.device) is None or not 0 < slot.accelerators < 1:
            return None
        return id(slot.pg), slot.bundle

    def nodes(self) -> set[str]:
        """The ids of the nodes the run's bundles were placed on."""
        from ray.util.placement_group import placement_group_table

        return {node for pg in self.groups
                for node in placement_group_table(pg)["bundles_to_node_id"].values()}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            remove_placement_group(pg)
        self.groups = []


def cpus_needed(cfg: TrainConfig, world_size: int) -> float:
    """CPUs the run's actors reserve, for starting a local cluster big enough to place them."""
    n = world_size + cfg.controller.rollout_engines + len(teacher_actor_endpoints(cfg))
    return n * cfg.controller.cpus_per_worker
