"""Checkpoints of `opkd train` without engines: a fake engine writes one file, everything else is real.

Pruning, the fresh-run / --resume / --overwrite rules for the output directory, durable writes,
torn metrics lines, the config comparison on resume, RNG files (accelerator state, weights-only
loading) and the weight version the rollout engine gets back.
"""
from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest
import torch
import yaml

from opkd_mcore.config import ConfigError, LoggingSection, TrainConfig, dump_config, load_config, to_dict
from opkd_mcore.train import checkpoint as ckpt
from opkd_mcore.train.checkpoint import TrainerState
from opkd_mcore.train.metrics import MetricsLogger, read_jsonl
from tests._hf_config import hf_checkpoint


class FakeEngine:
    """Stands in for `MegatronEngine`: its checkpoint is one file holding a number."""

    def __init__(self, value: int = 0):
        self.value = value

    def save_checkpoint(self, ckpt_dir: str) -> None:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(os.path.join(ckpt_dir, "weights.txt"), "w") as f:
            f.write(str(self.value))

    def load_checkpoint(self, ckpt_dir: str) -> None:
        with open(os.path.join(ckpt_dir, "weights.txt")) as f:
            self.value = int(f.read())


def _cfg(out, **run) -> TrainConfig:
    cfg = TrainConfig()
    cfg.run.output_dir = str(out)
    for key, value in run.items():
        setattr(cfg.run, key, value)
    return cfg


def _save(cfg: TrainConfig, step: int, keep_last: int = 2, version: int | None = None) -> str:
    state = TrainerState(step=step, weight_version=step if version is None else version)
    return ckpt.save_checkpoint(cfg.run.output_dir, FakeEngine(step), state, dump_config(cfg), keep_last)


def _tree(root) -> dict[str, bytes]:
    """Every file under `root` with its bytes (to show that nothing was modified)."""
    out = {}
    for here, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(here, name), "rb") as f:
                out[os.path.relpath(os.path.join(here, name), root)] = f.read()
    return out


# ---------------------------------------------------------------- 1. pruning


def test_prune_keeps_the_checkpoint_just_written_and_anything_newer(tmp_path):
    cfg = _cfg(tmp_path)
    root = ckpt.checkpoint_root(str(tmp_path))
    for step in (8, 10):  # an older run's checkpoints of higher steps
        _save(cfg, step)
    path = _save(cfg, 2)
    assert os.path.isfile(os.path.join(path, "trainer_state.json"))
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    assert sorted(os.listdir(root)) == ["latest", "step_000002", "step_000008", "step_000010"]


def test_prune_orders_by_step_number_not_by_name(tmp_path):
    cfg = _cfg(tmp_path)
    _save(cfg, 999_998, keep_last=1)
    path = _save(cfg, 1_000_000, keep_last=1)  # "step_1000000" sorts before "step_999998" by name
    assert os.path.isdir(path)
    assert sorted(os.listdir(ckpt.checkpoint_root(str(tmp_path)))) == ["latest", "step_1000000"]


def test_prune_keeps_the_last_n(tmp_path):
    cfg = _cfg(tmp_path)
    for step in (2, 4, 6):
        _save(cfg, step)
    assert sorted(os.listdir(ckpt.checkpoint_root(str(tmp_path)))) == ["latest", "step_000004", "step_000006"]


# ---------------------------------------------------------------- 2./3. fresh run, --resume, --overwrite


def test_fresh_run_refuses_a_directory_holding_checkpoints(tmp_path):
    cfg = _cfg(tmp_path)
    _save(cfg, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    before = _tree(tmp_path)
    with pytest.raises(ConfigError) as err:
        ckpt.prepare_run_dir(cfg, resume=False)
    msg = str(err.value)
    assert str(tmp_path) in msg and "checkpoints" in msg and "metrics.jsonl" in msg
    assert "--resume" in msg and "--overwrite" in msg
    assert "run.overwrite" not in msg  # one command line's flag, never a config key
    assert _tree(tmp_path) == before


def test_fresh_run_accepts_a_missing_or_empty_checkpoint_directory(tmp_path):
    assert ckpt.prepare_run_dir(_cfg(tmp_path / "new"), resume=False) is None
    os.makedirs(ckpt.checkpoint_root(str(tmp_path)))
    assert ckpt.prepare_run_dir(_cfg(tmp_path), resume=False) is None


def test_overwrite_removes_old_checkpoints_and_metrics(tmp_path):
    cfg = _cfg(tmp_path)
    _save(cfg, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    assert ckpt.prepare_run_dir(cfg, resume=False, overwrite=True) is None
    assert not os.path.exists(ckpt.checkpoint_root(str(tmp_path)))
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("latest", [None, "step_000004"])  # no pointer / a pointer to a missing dir
def test_resume_without_a_checkpoint_is_an_error_and_modifies_nothing(tmp_path, latest):
    root = tmp_path / "checkpoints"
    if latest:
        root.mkdir()
        (root / "latest").write_text(latest)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    before = _tree(tmp_path)
    with pytest.raises(ConfigError) as err:
        ckpt.prepare_run_dir(_cfg(tmp_path), resume=True)
    assert str(err.value).startswith("--resume") and str(root) in str(err.value)
    assert _tree(tmp_path) == before


def test_resume_returns_the_latest_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    _save(cfg, 2)
    path = _save(cfg, 4)
    assert ckpt.prepare_run_dir(cfg, resume=True) == path


def _hf_dir(path, name):
    # config and tokenizer: what `opkd train`'s start-up checks read before build_run
    return hf_checkpoint(path, name)


def write_cli_config(tmp_path, monkeypatch) -> tuple[str, object, dict]:
    """(path, output dir, tree) of a valid config file for `opkd train`; engines are never started
    (build_run fails the test)."""
    from opkd_mcore.train import spmd

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def no_engines(*args, **kwargs):
        raise AssertionError("build_run was called: the engines would have started")

    monkeypatch.setattr(spmd, "build_run", no_engines)
    cfg = {"model": {"student": _hf_dir(tmp_path, "student")},
           "parallel": {"micro_batch_size": 2, "global_batch_size": 8},
           "loss": {"support": "teacher"},
           "teacher": {"teachers": [{"backend": "hf", "model": _hf_dir(tmp_path, "teacher"), "top_k": 4}]},
           "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), tmp_path / "run", cfg


@pytest.fixture
def cli_config(tmp_path, monkeypatch):
    config, out, _ = write_cli_config(tmp_path, monkeypatch)
    return config, out


def test_cli_resume_with_nothing_to_resume_exits_2_with_one_line(cli_config, capsys):
    from opkd_mcore.launch import main

    config, out = cli_config
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["--config", config, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opkd train: error: --resume") and str(out) in err[0]
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_cli_fresh_run_over_checkpoints_exits_2_and_overwrite_replaces_them(cli_config, capsys):
    from opkd_mcore.launch import main, parse_args

    config, out = cli_config
    _save(_cfg(out), 2)
    assert main(["--config", config]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert os.path.isdir(out / "checkpoints" / "step_000002")
    assert parse_args(["--config", config, "--overwrite"]).overwrite
    with pytest.raises(AssertionError, match="build_run was called"):
        main(["--config", config, "--overwrite"])
    assert not os.path.exists(out / "checkpoints")


# ---------------------------------------------------------------- 4. durable writes


def test_checkpoint_files_and_latest_pointer_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = _save(_cfg(tmp_path), 2)
    root = ckpt.checkpoint_root(str(tmp_path))
    files = [os.path.join(path, "trainer_state.json"), os.path.join(path, "config.yaml"),
             os.path.join(path, "rng", "rank_00000.pt"), path]
    for f in files:
        assert f in synced, (f, synced)
    pointer = synced.index(os.path.join(root, "latest.tmp"))
    assert all(synced.index(f) < pointer for f in files), synced
    assert root in synced[pointer + 1:], "the directory holding `latest` is fsynced after the rename"


# ---------------------------------------------------------------- 5. torn metrics.jsonl


def test_resume_drops_a_torn_last_metrics_line_and_later_steps(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": s / 2}) + "\n" for s in range(4))
                    + '{"step": 4, "train/lo')
    log = MetricsLogger(str(tmp_path), LoggingSection(progress_bar=False, console_every=0), 10, start_step=3)
    log.log(3, {"train/loss": 30.0})
    log.close()
    rows = read_jsonl(str(path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["train/loss"] == 30.0
    assert rows[1]["train/loss"] == 0.5


def test_a_bad_metrics_line_before_the_last_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, \n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_jsonl(str(path))


# ---------------------------------------------------------------- 6. config comparison


def test_resume_refuses_config_changes_that_change_the_math(tmp_path):
    cfg = _cfg(tmp_path)
    _save(cfg, 2)
    changed = _cfg(tmp_path)
    changed.loss.beta = 0.25
    changed.teacher.teachers[0].top_k = 4
    with pytest.raises(ConfigError) as err:
        ckpt.prepare_run_dir(changed, resume=True)
    msg = str(err.value)
    assert "loss.beta: 0.5 in the checkpoint, 0.25 now" in msg
    assert "teacher.teachers.0.top_k: 16 in the checkpoint, 4 now" in msg
    assert "config.yaml" in msg


def test_resume_logs_operational_changes(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(cfg, 2)
    changed = _cfg(tmp_path, steps=20)
    changed.logging.console_every = 5
    changed.checkpoint.keep_last = 3
    changed.parallel.tp = 2
    changed.weight_sync.bucket_mb = 8
    changed.rollout.gpu_memory_utilization = 0.5
    changed.teacher.teachers[0].url = "http://elsewhere:8000"
    with caplog.at_level(logging.INFO, logger=ckpt.__name__):
        assert ckpt.prepare_run_dir(changed, resume=True) is not None
    text = caplog.text
    for key in ("run.steps: 10 in the checkpoint, 20 now", "logging.console_every", "checkpoint.keep_last",
                "parallel.tp: 1 in the checkpoint, 2 now", "weight_sync.bucket_mb",
                "rollout.gpu_memory_utilization", "teacher.teachers.0.url"):
        assert key in text, (key, text)


def test_more_steps_are_refused_when_the_lr_decay_length_follows_them(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.optim.lr_decay_style = "linear"  # lr_decay_steps null: decays over run.steps
    _save(cfg, 2)
    cfg.run.steps = 20
    with pytest.raises(ConfigError, match=r"optim.lr_decay_steps.*10 in the checkpoint, 20 now"):
        ckpt.prepare_run_dir(cfg, resume=True)
    cfg.optim.lr_decay_steps = 10  # the decay length kept explicitly: more steps are fine
    assert ckpt.prepare_run_dir(cfg, resume=True) is not None


def test_layout_changes_are_refused_with_the_distributed_optimizer(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.optim.use_distributed_optimizer = True
    _save(cfg, 2)
    cfg.parallel.tp = 2
    with pytest.raises(ConfigError, match=r"parallel.tp: 1 in the checkpoint, 2 now"):
        ckpt.prepare_run_dir(cfg, resume=True)


def test_export_only_needs_a_checkpoint_and_the_same_model_only(tmp_path, caplog):
    with pytest.raises(ConfigError, match=r"^--export-only: no complete checkpoint"):
        ckpt.prepare_run_dir(_cfg(tmp_path), resume=False, export_only=True)
    cfg = _cfg(tmp_path)
    path = _save(cfg, 2)
    cfg.loss.beta = 0.25  # irrelevant to an export: logged
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.prepare_run_dir(cfg, resume=False, export_only=True) == path
    assert "loss.beta" in caplog.text
    cfg.model.params_dtype = "bfloat16"
    with pytest.raises(ConfigError, match=r"model.params_dtype: 'float32' in the checkpoint, 'bfloat16' now"):
        ckpt.prepare_run_dir(cfg, resume=False, export_only=True)


def test_every_config_key_is_classified():
    keys = ckpt.flat_config(to_dict(TrainConfig()))
    unclassified = [k for k in keys if ckpt.classify_key(k) is None]
    assert not unclassified, f"add these to checkpoint.RESUMABLE_KEYS or RESULT_KEYS: {unclassified}"
    assert ckpt.classify_key("run.seed") == "result" and ckpt.classify_key("logging.jsonl") == "resumable"


# ---------------------------------------------------------------- 7./8. RNG files


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_round_trip_includes_the_accelerator_and_loads_weights_only(tmp_path, monkeypatch):
    import torch.cuda as accel  # the platform layer picks it from OPKD_DEVICE

    saved_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setenv("OPKD_DEVICE", "cuda")
    monkeypatch.setattr(accel, "get_rng_state", lambda *a, **k: saved_state.clone())
    monkeypatch.setattr(accel, "set_rng_state", lambda state, *a, **k: restored.append(state))
    real_load = torch.load

    def strict_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "RNG files must be loaded with weights_only=True"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", strict_load)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    path = _save(_cfg(tmp_path), 2)
    want = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    engine = FakeEngine()
    state = ckpt.load_checkpoint(path, engine)
    assert (state.step, engine.value) == (2, 2)
    assert _draws() == want
    assert len(restored) == 1 and torch.equal(restored[0], saved_state)


class _Payload:
    """Pickles to a call of `_mark`: what a tampered RNG file could run on load."""

    def __reduce__(self):
        return (_mark, ())


MARKS = []


def _mark():
    MARKS.append(1)
    return {}


def test_rng_files_are_not_unpickled_beyond_plain_data(tmp_path):
    path = _save(_cfg(tmp_path), 2)
    torch.save({"python": _Payload()}, os.path.join(path, "rng", "rank_00000.pt"))
    with pytest.raises(ValueError, match="rank_00000.pt"):
        ckpt.load_checkpoint(path, FakeEngine())
    assert not MARKS


# ---------------------------------------------------------------- 9. weight sync every N steps


def test_save_every_must_fall_on_weight_syncs(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"student": _hf_dir(tmp_path, "student")},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 8}, "loss": {"support": "teacher"},
        "teacher": {"teachers": [{"backend": "hf", "model": _hf_dir(tmp_path, "teacher"), "top_k": 4}]}}))
    with pytest.raises(ConfigError, match=r"^checkpoint.save_every: 3 .*weight_sync.every_steps = 2"):
        load_config(str(path), ["checkpoint.save_every=3", "weight_sync.every_steps=2"])
    load_config(str(path), ["checkpoint.save_every=4", "weight_sync.every_steps=2"])
    load_config(str(path), ["checkpoint.save_every=0", "weight_sync.every_steps=3"])


def test_rollout_version_on_resume():
    # at a sync boundary the restored student is what the engine held: same version
    assert ckpt.rollout_version_on_resume(TrainerState(step=4, weight_version=2), every_steps=2) == 2
    # an end-of-run checkpoint between syncs: the restored (newer) weights are a new version
    assert ckpt.rollout_version_on_resume(TrainerState(step=5, weight_version=2), every_steps=2) == 3
