"""configs/gpu_qwen3_8b_from_14b_ray_x4.yaml without a GPU: `opkd train --check` accepts it over weightless
checkpoints of the real Qwen3-8B and Qwen3-14B shapes, and on a local Ray cluster declaring four GPUs
the controller's placement gives the trainer ranks, the rollout engine and the teacher disjoint GPUs,
with the weight sync on a group transport (NCCL there), not device IPC. The same for the layout the GPU
lane runs on 80 GB cards (trainer at PP=3 on three GPUs, engine and teacher sharing the fourth)."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import yaml

from opkd_mcore import launch
from opkd_mcore.config import launch_world_size, load_config
from opkd_mcore.controller.groups import WorkerGroups
from opkd_mcore.controller.placement import Placement
from opkd_mcore.models.tiny import NAMED_SHAPES
from tests._hf_config import hf_checkpoint
from tests._ray_gpus import cluster_declaring_gpus, gpus_of

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "gpu_qwen3_8b_from_14b_ray_x4.yaml")
# what tools/gpu/lane.sh train4_ray adds on GPUs under 100 GiB (RAY4_LAYOUT=3+1; the config's header)
H100_LAYOUT = ["parallel.tp=1", "parallel.pp=3", "parallel.world_size=3",
               "controller.teachers_with_rollout=true", "rollout.gpu_memory_utilization=0.45"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config.json + tokenizer of the real shapes: what the checks read, no weights."""
    root = tmp_path_factory.mktemp("models")
    return {name: hf_checkpoint(root, name, **dataclasses.asdict(NAMED_SHAPES[name]))
            for name in ("qwen3-8b", "qwen3-14b")}


def overrides(models, tmp_path) -> list[str]:
    return [f"model.student={models['qwen3-8b']}", f"teacher.teachers.0.model={models['qwen3-14b']}",
            f"run.output_dir={tmp_path / 'run'}"]


@pytest.mark.parametrize("layout", [[], H100_LAYOUT], ids=["2+1+1", "3+1"])
def test_check_accepts_the_config(models, tmp_path, capsys, monkeypatch, layout):
    def started(*args, **kwargs):
        raise AssertionError("--check started the run")

    monkeypatch.setattr(launch, "train_with_ray", started)
    assert launch.main(["--check", "--config", CONFIG, *overrides(models, tmp_path), *layout]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["controller"]["kind"] == "ray" and printed["controller"]["placement"] == "disaggregated"
    assert printed["run"]["schedule"] == "one_step_off"
    assert printed["teacher"]["teachers"][0]["backend"] == "vllm"
    assert printed["teacher"]["teachers"][0]["top_k"] == 64
    assert printed["parallel"]["tp"] * printed["parallel"]["pp"] == printed["parallel"]["world_size"]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    with cluster_declaring_gpus(num_gpus=4, num_cpus=6) as ray:
        yield ray


@pytest.mark.parametrize("layout", [[], H100_LAYOUT], ids=["2+1+1", "3+1"])
def test_placement_on_four_gpus_keeps_the_groups_apart(cluster, models, tmp_path, layout):
    cfg = load_config(CONFIG, [*overrides(models, tmp_path), *layout, "run.device=cuda"])
    world = launch_world_size(cfg)
    placement = Placement(cfg, world, timeout_s=60)
    try:
        trainer, rollout, teacher = (gpus_of(cluster, slots) for slots in
                                     (placement.trainer, placement.rollout, placement.teachers))
        transport = WorkerGroups.transport(SimpleNamespace(cfg=cfg, placement=placement))
    finally:
        placement.remove()
    assert len(trainer) == world == (2 if not layout else 3)
    assert all(len(ids) == 1 for ids in trainer + rollout + teacher), (trainer, rollout, teacher)
    trainer_gpus = {ids[0] for ids in trainer}
    assert len(trainer_gpus) == world  # one GPU per rank
    assert len(rollout) == 1 and len(teacher) == 1
    engine_gpu, teacher_gpu = rollout[0][0], teacher[0][0]
    assert engine_gpu not in trainer_gpus and teacher_gpu not in trainer_gpus
    if layout:  # 80 GB cards: the engine and the teacher share the fourth GPU, half of it each
        assert engine_gpu == teacher_gpu
        assert placement.rollout[0].accelerators == placement.teachers[0].accelerators == 0.5
    else:
        assert engine_gpu != teacher_gpu
    assert trainer_gpus | {engine_gpu, teacher_gpu} == {0, 1, 2, 3}
    assert transport == "group"
