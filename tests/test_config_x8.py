"""The eight-GPU configs without a GPU, over weightless checkpoints of the real Qwen3-8B and Qwen3-32B shapes:

- configs/gpu_qwen3_8b_from_32b_x8.yaml passes the start-up checks; its eight ranks are TP=4 x DP=2, and
  the teacher server its header starts (and `tools/gpu/lane.sh train8_served` starts: the same command) is
  the one its teacher URL names, at TP=4 on four GPUs that leave GPU 0 to the rollout engine;
- configs/gpu_qwen3_8b_from_32b_megatron_x8.yaml: student and in-step teacher at TP=4 x PP=2 over eight ranks;
- configs/gpu_qwen3_8b_from_32b_ray_x8.yaml: `opkd train --check` accepts it for each schedule the lane runs,
  and on a local Ray cluster declaring eight GPUs the controller's placement gives the four trainer ranks,
  the two rollout engines and the two teachers disjoint GPUs that add up to the eight, the weight sync on a
  group transport;
- `opkd bench step --config` runs a file's workload: the shape options are refused beside it, the bench's
  run settings apply over the file's.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
import yaml

from opkd_mcore import launch
from opkd_mcore.config import launch_world_size, load_config
from opkd_mcore.controller.groups import WorkerGroups
from opkd_mcore.controller.placement import Placement
from opkd_mcore.models.tiny import NAMED_SHAPES
from opkd_mcore.teacher.serve import _parser as serve_parser
from opkd_mcore.train.preflight import preflight
from tests._hf_config import hf_checkpoint
from tests._ray_gpus import cluster_declaring_gpus, gpus_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED = os.path.join(ROOT, "configs", "gpu_qwen3_8b_from_32b_x8.yaml")
MEGATRON = os.path.join(ROOT, "configs", "gpu_qwen3_8b_from_32b_megatron_x8.yaml")
RAY = os.path.join(ROOT, "configs", "gpu_qwen3_8b_from_32b_ray_x8.yaml")
LANE_X8 = os.path.join(ROOT, "tools", "gpu", "lane_x8.sh")  # lane.sh's eight-GPU steps
GPUS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config.json + tokenizer of the real shapes: what the checks read, no weights."""
    root = tmp_path_factory.mktemp("models")
    return {name: hf_checkpoint(root, name, **dataclasses.asdict(NAMED_SHAPES[name]))
            for name in ("qwen3-8b", "qwen3-32b")}


def overrides(models, tmp_path, teacher: bool = True) -> list[str]:
    return [f"model.student={models['qwen3-8b']}", f"run.output_dir={tmp_path / 'run'}",
            *([f"teacher.teachers.0.model={models['qwen3-32b']}"] if teacher else [])]


def _serve_commands(lines: list[str]) -> list[tuple[dict, list[str]]]:
    """(environment, `opkd teacher-serve` arguments) of each teacher-serve command in shell `lines`
    (`\\` continuations joined; comments, output redirections and `&` dropped)."""
    text = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if "teacher-serve" not in line:  # prose lines are no shell
            continue
        argv = shlex.split(re.sub(r"[0-9]*[<>].*$|&\s*$", "", line.strip()), comments=True)
        if "teacher-serve" not in argv:
            continue
        env = {}
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        out.append((env, argv[argv.index("teacher-serve") + 1:]))
    return out


def _header_lines(path: str) -> list[str]:
    with open(path) as f:
        header = f.read().split("\nmodel:", 1)[0]
    return [line.lstrip("#").strip() for line in header.splitlines() if line.startswith("#   ")]


def _lane_step(step: str) -> list[str]:
    with open(LANE_X8) as f:
        body = f.read().split(f"\n    {step})", 1)[1].split(";;", 1)[0]
    return body.splitlines()


def test_served_config_shares_gpus_4_to_7_with_its_teacher_server(models, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(SERVED, overrides(models, tmp_path, teacher=False))
    preflight(cfg, probe_servers=False)
    par, (teacher,) = cfg.parallel, cfg.teacher.teachers
    dp = launch_world_size(cfg) // (par.tp * par.pp * par.cp)
    assert (par.tp, par.pp, dp, launch_world_size(cfg)) == (4, 1, 2, GPUS)
    assert par.global_batch_size == cfg.rollout.prompts_per_step * cfg.rollout.n == 512
    assert cfg.controller.kind == "torchrun" and cfg.weight_sync.transport == "colocated_ipc"
    assert teacher.backend == "remote" and teacher.top_k == 64 and not teacher.replica_urls
    url = urlparse(teacher.url)
    assert url.hostname == "127.0.0.1"
    (header_env, header_argv), = _serve_commands(_header_lines(SERVED))
    (lane_env, lane_argv), = _serve_commands(_lane_step("train8_served"))
    args = serve_parser().parse_args(header_argv)
    # the lane starts the server the header documents
    assert vars(serve_parser().parse_args(lane_argv)) == vars(args) and lane_env == header_env
    assert args.port == url.port and args.k >= teacher.top_k and args.tp == 4
    assert args.max_model_len == cfg.rollout.max_model_len
    server_gpus = [int(i) for i in header_env["CUDA_VISIBLE_DEVICES"].split(",")]
    # the server's TP=4 on four of the host's GPUs, none of them GPU 0, where the rollout engine is
    assert len(set(server_gpus)) == args.tp and set(server_gpus) <= set(range(GPUS)) and 0 not in server_gpus
    # both engines keep a share of their GPU: together under the whole GPU beside the trainer's rank
    assert args.gpu_memory_utilization + cfg.rollout.gpu_memory_utilization < 1


def test_megatron_config_splits_student_and_teacher_over_eight_ranks(models, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(MEGATRON, overrides(models, tmp_path))
    preflight(cfg, probe_servers=False)  # TP=4 divides both models' heads, PP=2 both models' layers
    par, (teacher,) = cfg.parallel, cfg.teacher.teachers
    assert (par.tp, par.pp, launch_world_size(cfg)) == (4, 2, GPUS) and par.tp * par.pp == GPUS
    assert teacher.backend == "megatron" and cfg.loss.support is None
    assert par.global_batch_size == cfg.rollout.prompts_per_step * cfg.rollout.n == 512
    # everything but the teacher and its objective as in the served run
    served = load_config(SERVED, overrides(models, tmp_path, teacher=False))
    for section in ("model", "rollout", "data", "optim", "weight_sync"):
        assert getattr(cfg, section) == getattr(served, section), section
    assert (cfg.loss.divergence, cfg.loss.aggregation) == (served.loss.divergence, served.loss.aggregation)


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "async"])
def test_check_accepts_the_ray_config(models, tmp_path, capsys, monkeypatch, schedule):
    def started(*args, **kwargs):
        raise AssertionError("--check started the run")

    monkeypatch.setattr(launch, "train_with_ray", started)
    assert launch.main(["--check", "--config", RAY, *overrides(models, tmp_path),
                        f"run.schedule={schedule}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["controller"]["kind"] == "ray" and printed["controller"]["placement"] == "disaggregated"
    assert printed["teacher"]["teachers"][0]["backend"] == "vllm"
    assert printed["teacher"]["teachers"][0]["top_k"] == 64
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    with cluster_declaring_gpus(num_gpus=GPUS, num_cpus=GPUS + 2) as ray:
        yield ray


def test_ray_placement_on_eight_gpus_keeps_the_groups_apart(cluster, models, tmp_path):
    cfg = load_config(RAY, [*overrides(models, tmp_path), "run.device=cuda"])
    world = launch_world_size(cfg)
    placement = Placement(cfg, world, timeout_s=60)
    try:  # one actor per slot, all started at once
        ids = gpus_of(cluster, placement.trainer + placement.rollout + placement.teachers)
        transport = WorkerGroups.transport(SimpleNamespace(cfg=cfg, placement=placement))
    finally:
        placement.remove()
    engines = len(placement.rollout)
    trainer, rollout, teacher = ids[:world], ids[world:world + engines], ids[world + engines:]
    assert (world, cfg.parallel.tp) == (4, 4)
    assert (len(rollout), len(teacher)) == (cfg.controller.rollout_engines, cfg.controller.teacher_replicas)
    assert (len(rollout), len(teacher)) == (2, 2)
    assert all(len(ids) == 1 for ids in trainer + rollout + teacher), (trainer, rollout, teacher)
    gpus = [ids[0] for ids in trainer + rollout + teacher]
    assert sorted(gpus) == list(range(GPUS)), (trainer, rollout, teacher)  # disjoint, all eight used
    assert transport == "group"


def test_bench_step_takes_a_config_file_and_refuses_shape_options(models, tmp_path, capsys):
    from tools import bench_step

    with pytest.raises(SystemExit):
        bench_step.parse_args(["--config", RAY, "--prompts", "4", "--tp", "2"])
    assert "--prompts, --tp: --config" in capsys.readouterr().err
    models_only = [o for o in overrides(models, tmp_path) if o.startswith(("model.", "teacher."))]
    args = bench_step.parse_args(["--config", RAY, "--steps", "3", *models_only, "rollout.n=2",
                                  "parallel.global_batch_size=128"])
    base = bench_step.file_overrides(args, str(tmp_path / "bench" / "run"))
    cfg = load_config(RAY, base + ["run.schedule=async"])
    plain = load_config(RAY, overrides(models, tmp_path))
    assert cfg.run.steps == 3 and cfg.run.output_dir == str(tmp_path / "bench" / "run")
    assert cfg.run.schedule == "async" and cfg.rollout.n == 2
    assert not cfg.checkpoint.save_at_end and not cfg.checkpoint.export_hf_at_end
    assert cfg.logging.jsonl  # each schedule's metrics.jsonl stays for the step table
    assert cfg.parallel.global_batch_size == 128
    assert (cfg.parallel.tp, cfg.parallel.world_size, cfg.controller, cfg.teacher) == \
        (plain.parallel.tp, plain.parallel.world_size, plain.controller, plain.teacher)
    assert bench_step.parse_args(["--prompts", "4"]).prompts == 4  # without --config: as before


def test_step_table_shares_of_the_step(tmp_path, capsys):
    import json
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
    try:
        import step_table
    finally:
        sys.path.pop(0)
    rows = [{"timing/step": 99.0, "timing/rollout": 99.0},  # the warm-up step, left out
            {"timing/step": 10.0, "timing/rollout": 6.0, "timing/teacher": 2.0, "timing/train": 9.0},
            {"timing/step": 30.0, "timing/rollout": 10.0, "timing/teacher": 4.0, "timing/train": 15.0}]
    path = tmp_path / "overlapped_metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = [c.strip() for c in step_table.shares(str(path), skip=1).strip("|").split("|")]
    # means 8 / 3 / 12 s of a 20 s step, no weight-sync timing: the stages of an overlapped step add up
    # to more than the step
    assert cells == ["overlapped_metrics.jsonl", "2", "20.00", "40%", "15%", "60%", "-", "115%"]
    step_table.main([str(path), "--shares"])
    assert "| overlapped_metrics.jsonl | 2 | 20.00 | 40% | 15% | 60% | - | 115% |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_step_runs_a_config_files_workload_and_keeps_each_schedules_metrics(tmp_path):
    """`opkd bench step --config FILE --out DIR`: the file's run (tiny models, an hf teacher, on CPU) under
    each schedule on one set of actors, the bench's step count over the file's, DIR/<schedule>/metrics.jsonl
    a row per step (what `lane.sh train8_ray` copies for the step table)."""
    import json
    import subprocess
    import sys

    from tools.bench_step import tiny_models

    student, teacher = tiny_models(str(tmp_path), 64, 2)
    config = {"model": {"student": student}, "parallel": {"micro_batch_size": 4, "global_batch_size": 8},
              "loss": {"support": "teacher"},
              "rollout": {"prompts_per_step": 4, "n": 2, "max_new_tokens": 8, "max_model_len": 128},
              "teacher": {"teachers": [{"backend": "hf", "model": teacher, "top_k": 8}]},
              "data": {"num_train": 64}, "controller": {"kind": "ray"},
              "run": {"output_dir": str(tmp_path / "unused"), "steps": 5}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    out, results = tmp_path / "bench", tmp_path / "step.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", "bench", "step", "--config",
                           str(tmp_path / "tiny.yaml"), "--out", str(out), "--steps", "2", "--schedules",
                           "sync,one_step_off", "--json", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(json.loads(results.read_text())["results"]) == ["sync", "one_step_off"]
    for schedule in ("sync", "one_step_off"):
        rows = [json.loads(line) for line in (out / schedule / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(r["timing/step"] > 0 for r in rows), schedule
    assert not (tmp_path / "unused").exists()
