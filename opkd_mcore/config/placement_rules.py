"""What the Ray controller's colocated placement allows, and whether its engines sleep.

Colocated, trainer rank r, rollout engine r and teachers share the device of bundle r
(`controller/placement.py`). Under `sync` the engines sleep while the trainer trains; under an
overlapped schedule (`one_step_off`, ...) they generate the next step's samples beside the
training, resident, and the device is time-shared: where each stage alone leaves the device idle
(a launch-bound train step, vLLM's host-side decode loop) the overlap is what one device gains.
Decided here once: the engine actors build with sleep mode and the driver puts them to sleep only
where `engines_sleep_while_training` says so.
"""
from __future__ import annotations

from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.loss_rules import runs_in_step
from opkd_mcore.config.model_checks import launch_world_size
from opkd_mcore.config.schema import TeacherEndpoint, TrainConfig
from opkd_mcore.platform.device import device_type, is_cpu


def colocated_under_ray(cfg: TrainConfig) -> bool:
    """Whether the Ray controller's engines share the trainer ranks' devices (the torchrun job's
    engine lives in the trainer's process and stays resident)."""
    return cfg.controller.kind == "ray" and cfg.controller.placement == "colocated"


def engines_sleep_while_training(cfg: TrainConfig) -> bool:
    """Whether colocated rollout engines free their memory while the trainer trains: under `sync`
    only (an overlapped schedule generates while the trainer trains)."""
    return colocated_under_ray(cfg) and cfg.run.schedule == "sync"


def teacher_actor_endpoints(cfg: TrainConfig) -> list[tuple[TeacherEndpoint, str | None]]:
    """(endpoint, url) of every scoring-teacher actor: `controller.teacher_replicas` per in-process
    teacher, one per URL of a remote one; none for an in-step teacher (megatron, or self with dense
    output: it runs in the trainer)."""
    actors = []
    for t in cfg.teacher.teachers:
        if runs_in_step(t):
            continue
        if t.backend == "remote":
            actors += [(t, url) for url in [t.url, *t.replica_urls]]
        else:
            actors += [(t, None)] * cfg.controller.teacher_replicas
    return actors


def colocated_bundles(cfg: TrainConfig, world_size: int) -> tuple[list[int], list[int]]:
    """The bundle of the colocated pool (one per trainer rank) that each rollout engine and each
    teacher actor (in `teacher_actor_endpoints` order) joins: round-robin over the trainer ranks."""
    return ([e % world_size for e in range(cfg.controller.rollout_engines)],
            [i % world_size for i in range(len(teacher_actor_endpoints(cfg)))])


def resident_vllm_engines(cfg: TrainConfig) -> int:
    """The most vLLM engines resident on one colocated device while the trainer trains: rollout
    engines that do not sleep and in-process vLLM teachers."""
    ranks = launch_world_size(cfg)
    engine_at, teacher_at = colocated_bundles(cfg, ranks)
    per_device = [0] * ranks
    if not engines_sleep_while_training(cfg):
        for b in engine_at:
            per_device[b] += 1
    for b, (t, _) in zip(teacher_at, teacher_actor_endpoints(cfg)):
        per_device[b] += t.backend == "vllm"
    return max(per_device)


def check_colocated(cfg: TrainConfig) -> None:
    """The colocated placement's transports, engine count and device memory."""
    ctl = cfg.controller
    if ctl.kind != "ray":
        return
    if ctl.placement != "colocated":
        if cfg.weight_sync.transport == "colocated_ipc":
            raise ConfigError("weight_sync.transport: colocated_ipc moves weights between processes on one "
                              "device; disaggregated rollout engines need group (or auto)")
        return
    if cfg.weight_sync.transport == "group" and not is_cpu(cfg.run.device):  # None: the device found
        raise ConfigError(f"weight_sync.transport: group puts colocated engine 0 on trainer rank 0's "
                          f"device, and a {device_type(cfg.run.device)} collective refuses two members "
                          "on one device; use colocated_ipc (or auto) with placement: colocated")
    engines_devices = ctl.rollout_engines * ctl.rollout_tp
    if engines_devices > launch_world_size(cfg):
        raise ConfigError(f"controller.rollout_engines: colocated engines use the trainer's devices: "
                          f"rollout_engines*rollout_tp = {engines_devices} exceeds the "
                          f"{launch_world_size(cfg)} trainer ranks")
    resident = resident_vllm_engines(cfg)
    share = resident * cfg.rollout.gpu_memory_utilization
    if not is_cpu(cfg.run.device) and share >= 1.0:
        why = "" if engines_sleep_while_training(cfg) else \
            f" (under run.schedule: {cfg.run.schedule} the rollout engines generate while the trainer trains)"
        raise ConfigError(f"rollout.gpu_memory_utilization: {resident} vLLM engines stay on one colocated "
                          f"device while the trainer trains{why}, each taking "
                          f"{cfg.rollout.gpu_memory_utilization} of it: {share:.2f} leaves the trainer "
                          f"nothing; expected below {1.0 / resident:.2f}")
