"""Nothing a user owns is deleted by mistake: `--overwrite` only on a command line, a fresh run over an
earlier run's output refused, a dangling `latest` resumed from the newest complete checkpoint, the HF
export swapped in whole, TensorBoard's discarded steps purged on resume. No engine starts here.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import types

import pytest
import torch
import yaml
from safetensors.torch import load_file

from opkd_mcore.config import ConfigError, LoggingSection, TrainConfig, dump_config, load_config
from opkd_mcore.config.schema import RunSection
from opkd_mcore.models import weights
from opkd_mcore.train import checkpoint as ckpt
from opkd_mcore.train.checkpoint import TrainerState
from opkd_mcore.train.metrics import MetricsLogger
from opkd_mcore.train.samples_log import write_skipped
from tests.test_train_checkpoint import FakeEngine, _tree, write_cli_config

OVERWRITE_MESSAGE = ("run.overwrite: overwriting is asked for on the command line with --overwrite, never "
                     "in a config file")


def _cfg(out) -> TrainConfig:
    cfg = TrainConfig()
    cfg.run.output_dir = str(out)
    return cfg


def _save(out, step: int) -> str:
    cfg = _cfg(out)
    return ckpt.save_checkpoint(str(out), FakeEngine(step), TrainerState(step=step, weight_version=step),
                                dump_config(cfg), keep_last=10)


def _write(path, text: str = "x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """`opkd train`'s `main` with a valid config file; engines never start (build_run fails the test)."""
    from opkd_mcore.launch import main

    config, out, tree = write_cli_config(tmp_path, monkeypatch)
    return types.SimpleNamespace(main=main, config=config, tree=tree, out=out)


# ---------------------------------------------------------------- 1. --overwrite is one command line's


def test_run_overwrite_is_refused_in_a_file_and_in_an_override(cli, tmp_path):
    assert "overwrite" not in {f for f in RunSection.__dataclass_fields__}
    with pytest.raises(ConfigError) as err:
        load_config(cli.config, ["run.overwrite=true"])
    assert str(err.value) == OVERWRITE_MESSAGE
    tree = {**cli.tree, "run": {**cli.tree["run"], "overwrite": False}}
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(OVERWRITE_MESSAGE) and str(path) in str(err.value)


def test_cli_overwrite_is_not_carried_into_the_resolved_config(cli, capsys):
    with pytest.raises(AssertionError, match="build_run was called"):
        cli.main(["--config", cli.config, "--overwrite"])
    printed = yaml.safe_load(capsys.readouterr().out)  # the resolved config, as <output_dir>/config.yaml
    assert printed["run"]["output_dir"] == str(cli.out) and "overwrite" not in printed["run"]


def test_a_checkpoint_whose_saved_config_has_run_overwrite_resumes_silently(tmp_path, caplog):
    path = _save(tmp_path, 2)
    with open(os.path.join(path, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    saved["run"]["overwrite"] = True  # what the trainer wrote before the key left the schema
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump(saved, f)
    assert not any(p.startswith("run.overwrite") for p in ckpt.RESUMABLE_KEYS)
    with caplog.at_level(logging.INFO, logger=ckpt.__name__):
        assert ckpt.prepare_run_dir(_cfg(tmp_path), resume=True) == path
    assert "overwrite" not in caplog.text


def test_resume_and_overwrite_together_are_refused(cli, capsys):
    _save(cli.out, 2)
    before = _tree(cli.out)
    assert cli.main(["--config", cli.config, "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" in err
    assert _tree(cli.out) == before


@pytest.fixture
def demo_main(monkeypatch):
    """`opkd demo`'s `main`; building anything (the task, its first step once the config is checked and
    --out accepted) raises `Built`."""
    from opkd_mcore.demo import run as demo_run

    class Built(Exception):
        pass

    def first_build_step(*args, **kwargs):
        raise Built

    monkeypatch.setattr(demo_run, "make_task", first_build_step)
    return demo_run.main, Built


def test_demo_refuses_an_earlier_demos_directory_and_overwrite_replaces_only_its_files(demo_main, tmp_path,
                                                                                          capsys):
    main, built = demo_main
    out = tmp_path / "demo"
    for name in ("summary.json", "metrics.jsonl", "teacher_hf/model.safetensors", "student_hf/config.json",
                 "notes.txt", "my_data/prompts.jsonl"):
        _write(str(out / name))
    before = _tree(out)
    assert main(["--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err and "summary.json" in err
    assert _tree(out) == before
    with pytest.raises(built):
        main(["--quick", "--out", str(out), "--overwrite"])
    assert sorted(_tree(out)) == ["my_data/prompts.jsonl", "notes.txt"]


@pytest.mark.parametrize("variant", ["distill", "cross_tokenizer", "self_distill"])
def test_demo_with_a_bad_override_value_stops_before_touching_out(demo_main, tmp_path, capsys, variant):
    """A value the config refuses ends the demo before anything is built, and before --overwrite
    removes an earlier demo's output."""
    main, _ = demo_main
    out = tmp_path / "demo"
    _write(str(out / "summary.json"))
    assert main(["--variant", variant, "--quick", "--out", str(out), "--overwrite", "loss.divergence=kl"]) == 2
    assert "loss.divergence: expected one of" in capsys.readouterr().err
    assert sorted(_tree(out)) == ["summary.json"]


def test_demo_refuses_an_out_that_is_a_file(demo_main, tmp_path, capsys):
    main, _ = demo_main
    out = tmp_path / "demo"
    out.write_text("mine")
    assert main(["--quick", "--out", str(out), "--overwrite"]) == 2
    assert str(out) in capsys.readouterr().err and out.read_text() == "mine"


# ---------------------------------------------------------------- 2. a fresh run over an earlier run's output


ARTIFACT_FILES = ("metrics.jsonl", "samples.jsonl", "student_hf/model.safetensors", "config.yaml",
                  "tensorboard/events.out.tfevents.1.host", "profile/step3.rank0.json")


@pytest.mark.parametrize("artifact", ARTIFACT_FILES)
def test_fresh_run_refuses_any_earlier_run_output_and_modifies_nothing(tmp_path, artifact):
    _write(str(tmp_path / artifact))
    before = _tree(tmp_path)
    for fn in (ckpt.check_run_dir, ckpt.prepare_run_dir):
        with pytest.raises(ConfigError) as err:
            fn(_cfg(tmp_path), resume=False)
        msg = str(err.value)
        assert msg.startswith("run.output_dir: ") and str(tmp_path) in msg
        assert artifact.split("/")[0] in msg and "--overwrite" in msg
        assert "--resume" not in msg  # no checkpoint to continue: --resume would be a dead end
    assert _tree(tmp_path) == before


def test_a_rank_checking_the_directory_ignores_the_skipped_prompts_rank0_of_its_run_just_wrote(tmp_path):
    """Rank 0 lists the skipped prompts while reading the data, before the ranks meet in
    `init_distributed`; a slower rank still checking the directory must not refuse the run for it."""
    path = write_skipped(str(tmp_path), [{"index": 0, "location": "d.jsonl:1", "prompt_tokens": 19}])
    before = _tree(tmp_path)
    for overwrite in (False, True):
        assert ckpt.check_run_dir(_cfg(tmp_path), resume=False, overwrite=overwrite) is None
        assert ckpt.prepare_run_dir(_cfg(tmp_path), resume=False, overwrite=overwrite) is None
    assert _tree(tmp_path) == before and os.path.basename(path) == "skipped_prompts.jsonl"


def test_cli_fresh_run_over_metrics_samples_and_export_exits_2_and_keeps_them(cli, capsys):
    for name in ("metrics.jsonl", "samples.jsonl", "student_hf/model.safetensors"):  # save_every: 0
        _write(str(cli.out / name), name)
    before = _tree(cli.out)
    assert cli.main(["--config", cli.config]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert _tree(cli.out) == before


def test_overwrite_removes_exactly_the_run_artifacts_and_logs_each(tmp_path, caplog):
    _save(tmp_path, 2)
    for name in (*ARTIFACT_FILES, ".student_hf.tmp-123/model.safetensors", "metrics.jsonl.tmp"):
        _write(str(tmp_path / name))
    mine = ("notes.txt", "metrics.jsonl.bak", "data/prompts.jsonl", "student_hf_v1/config.json")
    for name in mine:
        _write(str(tmp_path / name), "mine")
    cfg = _cfg(tmp_path)
    before = _tree(tmp_path)
    assert ckpt.check_run_dir(cfg, resume=False, overwrite=True) is None
    assert _tree(tmp_path) == before  # the check alone modifies nothing
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.prepare_run_dir(cfg, resume=False, overwrite=True) is None
    assert sorted(_tree(tmp_path)) == sorted(mine)
    for name in ("checkpoints", "metrics.jsonl", "samples.jsonl", "student_hf", "config.yaml", "tensorboard",
                 "profile", ".student_hf.tmp-123", "metrics.jsonl.tmp"):
        assert os.path.join(str(tmp_path), name) in caplog.text, name


def test_check_run_dir_modifies_nothing_on_resume_either(tmp_path):
    _save(tmp_path, 2)
    path = _save(tmp_path, 4)
    (tmp_path / "checkpoints" / "latest").write_text("step_000006")  # dangling
    before = _tree(tmp_path)
    assert ckpt.check_run_dir(_cfg(tmp_path), resume=True) == path
    assert _tree(tmp_path) == before


def test_an_output_dir_that_is_a_file_is_refused_by_key(tmp_path):
    out = tmp_path / "run"
    out.write_text("mine")
    for kwargs in ({"resume": False}, {"resume": False, "overwrite": True}, {"resume": True}):
        with pytest.raises(ConfigError, match=r"^run.output_dir: .* is an existing file"):
            ckpt.prepare_run_dir(_cfg(out), **kwargs)
    assert out.read_text() == "mine"


# ---------------------------------------------------------------- 3. a dangling `latest`


def _dangling(tmp_path, how: str) -> str:
    """Complete checkpoints of steps 2 and 4, and `latest` naming a step-6 one that is `how`."""
    _save(tmp_path, 2)
    good = _save(tmp_path, 4)
    root = tmp_path / "checkpoints"
    if how == "incomplete":  # killed mid-save: the engine part, no trainer state
        (root / "step_000006" / "engine").mkdir(parents=True)
    elif how == "torn state":
        _save(tmp_path, 6)
        (root / "step_000006" / "trainer_state.json").write_text('{"step": 6, "weight')
    (root / "latest").write_text("step_000006")
    return good


@pytest.mark.parametrize("how", ["missing", "incomplete", "torn state"])
def test_resume_falls_back_to_the_newest_complete_checkpoint_and_repairs_latest(tmp_path, caplog, how):
    good = _dangling(tmp_path, how)
    root = tmp_path / "checkpoints"
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.prepare_run_dir(_cfg(tmp_path), resume=True) == good
    assert str(root / "step_000006") in caplog.text and good in caplog.text
    assert (root / "latest").read_text() == "step_000004"
    assert not (root / "latest.tmp").exists()
    assert ckpt.require_checkpoint(str(tmp_path)) == good  # what every rank then loads
    engine = FakeEngine()
    assert ckpt.load_checkpoint(good, engine).step == 4 and engine.value == 4


def test_the_repair_of_latest_is_atomic(tmp_path, monkeypatch):
    _dangling(tmp_path, "missing")
    root = str(tmp_path / "checkpoints")
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((src, dst)), real_replace(src, dst)))
    ckpt.prepare_run_dir(_cfg(tmp_path), resume=True)
    assert replaced == [(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))]


def test_a_missing_latest_with_complete_checkpoints_resumes_too(tmp_path, caplog):
    good = _dangling(tmp_path, "missing")
    os.remove(tmp_path / "checkpoints" / "latest")
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.prepare_run_dir(_cfg(tmp_path), resume=True) == good
    assert "is missing" in caplog.text
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000004"


def test_a_fresh_run_over_a_dangling_latest_points_to_resume(tmp_path):
    _dangling(tmp_path, "missing")
    with pytest.raises(ConfigError, match="--resume"):
        ckpt.prepare_run_dir(_cfg(tmp_path), resume=False)


def test_the_trainer_state_is_written_after_every_other_part_of_a_checkpoint(tmp_path, monkeypatch):
    """What makes "has trainer_state.json" mean complete: it is fsynced after the engine part."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = _save(tmp_path, 2)
    state = synced.index(os.path.join(path, "trainer_state.json"))
    for part in ("engine/weights.txt", "engine", "rng", "config.yaml"):
        assert synced.index(os.path.join(path, part)) < state, part


# ---------------------------------------------------------------- 4. the HF export is swapped in whole


def _fake_model(monkeypatch, values: dict[str, float], fail_after: int | None = None):
    """Stands in for the chunks: `save_hf_checkpoint` streams `values` (name -> fill) as 4-float
    tensors; with `fail_after`, the stream raises after that many tensors (a crash mid-export)."""
    meta = [weights.WeightMeta(name, (4,), torch.float32, 0) for name in values]

    def stream(chunks, stages):
        for i, (name, value) in enumerate(values.items()):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("killed mid-export")
            yield name, torch.full((4,), value)

    monkeypatch.setattr(weights, "hf_weight_metadata", lambda chunks: meta)
    monkeypatch.setattr(weights, "iter_hf_weights", stream)


def _export(monkeypatch, tmp_path, values, fail_after=None):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text("{}")
    _fake_model(monkeypatch, values, fail_after)
    weights.save_hf_checkpoint([], str(tmp_path / "student_hf"), src_hf_dir=str(src), max_shard_bytes=16,
                               progress=False)


def _read_export(out) -> dict[str, float]:
    with open(os.path.join(out, weights.INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    return {name: float(load_file(os.path.join(out, file))[name][0]) for name, file in weight_map.items()}


def test_a_crash_mid_export_leaves_the_previous_export_whole(tmp_path, monkeypatch):
    _export(monkeypatch, tmp_path, {"a": 1.0, "b": 1.0, "c": 1.0})
    before = _tree(tmp_path / "student_hf")
    with pytest.raises(RuntimeError, match="killed mid-export"):
        _export(monkeypatch, tmp_path, {"a": 2.0, "b": 2.0, "c": 2.0}, fail_after=2)
    assert _tree(tmp_path / "student_hf") == before
    assert _read_export(tmp_path / "student_hf") == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert sorted(os.listdir(tmp_path)) == ["src", "student_hf"]  # no staging directory left


def test_a_new_export_replaces_the_old_one_entirely_and_durably(tmp_path, monkeypatch):
    _export(monkeypatch, tmp_path, {"a": 1.0, "b": 1.0, "c": 1.0})
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd)))
    _export(monkeypatch, tmp_path, {"a": 2.0, "b": 2.0})
    out = str(tmp_path / "student_hf")
    assert _read_export(out) == {"a": 2.0, "b": 2.0}
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", weights.INDEX_FILE]
    assert sorted(os.listdir(tmp_path)) == ["src", "student_hf"]
    parent = os.path.realpath(tmp_path)
    staging = os.path.join(parent, f".student_hf.tmp-{os.getpid()}")
    staged = [i for i, p in enumerate(synced) if p.startswith(staging)]
    assert {os.path.basename(synced[i]) for i in staged} >= set(os.listdir(out)), "every file fsynced"
    assert parent in synced[max(staged) + 1:], "the parent is fsynced after the rename"


def test_only_the_writer_rank_touches_the_filesystem(tmp_path, monkeypatch):
    _export(monkeypatch, tmp_path, {"a": 1.0})
    before = _tree(tmp_path)
    barriers = []
    monkeypatch.setattr(weights.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(weights.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(weights.dist, "barrier", lambda: barriers.append(1))
    _export(monkeypatch, tmp_path, {"a": 2.0})
    assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["src", "student_hf"]
    assert barriers == [1]


# ---------------------------------------------------------------- 5. TensorBoard on --resume


def _logging() -> LoggingSection:
    return LoggingSection(tensorboard=True, jsonl=True, progress_bar=False, console_every=0)


def test_a_resumed_run_asks_tensorboard_to_purge_the_discarded_steps(tmp_path, monkeypatch):
    """Runs without the `tensorboard` package: a stand-in SummaryWriter records how it is opened."""
    opened = []

    class Writer:
        def __init__(self, log_dir, purge_step=None, **kwargs):
            opened.append((log_dir, purge_step))

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    MetricsLogger(str(tmp_path), _logging(), 10, start_step=0).close()
    MetricsLogger(str(tmp_path), _logging(), 10, start_step=3).close()
    log_dir = os.path.join(str(tmp_path), "tensorboard")
    assert opened == [(log_dir, None), (log_dir, 3)]


def test_tensorboard_shows_no_event_of_a_discarded_step_after_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(str(tmp_path), _logging(), 5)
    for step in range(5):
        first.log(step, {"train/loss": float(step)})
    first.close()
    resumed = MetricsLogger(str(tmp_path), _logging(), 5, start_step=3)  # the checkpoint of step 3
    for step in (3, 4):
        resumed.log(step, {"train/loss": 10.0 + step})
    resumed.close()
    events = EventAccumulator(os.path.join(str(tmp_path), "tensorboard"))
    events.Reload()
    seen = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert seen == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
