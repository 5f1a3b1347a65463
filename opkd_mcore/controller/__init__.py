"""Ray controller: worker groups (trainer ranks, rollout engines, scoring teachers) as Ray actors in
placement groups, the four schedules, exactly-once data and fault handling. See docs/controller.md.

    opkd train --config run.yaml controller.kind=ray run.schedule=async
"""
from opkd_mcore.controller.driver import RayController, train_with_ray
from opkd_mcore.controller.groups import ActorLost, StageFailed, TrainerDied, WorkerGroups

__all__ = ["ActorLost", "RayController", "StageFailed", "TrainerDied", "WorkerGroups", "train_with_ray"]
