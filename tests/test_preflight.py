"""Start-up checks (`train/preflight.py`) and `opkd train --check`: models, context length, teacher
top_k, the output directory and the prompt files are refused by key before any engine starts, every
problem at once, with nothing started and nothing written."""
from __future__ import annotations

import os

import pytest
import yaml

from opkd_mcore import launch
from opkd_mcore.config import ConfigError, load_config, to_dict
from opkd_mcore.train import spmd
from opkd_mcore.train.preflight import PreflightError, preflight
from tests._hf_config import hf_checkpoint

UNSUPPORTED = dict(architecture="Phi3ForCausalLM", model_type="phi3")


@pytest.fixture
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"student": hf_checkpoint(root, "student"), "teacher": hf_checkpoint(root, "teacher"),
            "phi3": hf_checkpoint(root, "phi3", **UNSUPPORTED),
            "short": hf_checkpoint(root, "short", max_position_embeddings=128)}


def write_config(tmp_path, models, *overrides: str, teacher: dict | None = None) -> str:
    """A valid run over the weightless tiny checkpoints, with `overrides` applied; returns its path."""
    tree = {"model": {"student": models["student"]},
            "loss": {"support": "teacher"},
            "teacher": {"teachers": [teacher or {"backend": "vllm", "model": models["teacher"], "top_k": 8}]},
            "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    if overrides:  # through the loader, so that a refused override fails here, naming its key
        path.write_text(yaml.safe_dump(to_dict(load_config(str(path), list(overrides), validate=False))))
    return str(path)


def preflight_errors(path: str, **kwargs) -> list[str]:
    with pytest.raises(PreflightError) as err:
        preflight(load_config(path), probe_servers=False, **kwargs)
    return err.value.errors


@pytest.fixture(autouse=True)
def no_engines(monkeypatch):
    """Any engine start fails the test: the checks must run before and without them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def started(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(spmd, "build_run", started)
    monkeypatch.setattr(launch, "train_with_ray", started)
    monkeypatch.setattr(launch, "train_spmd", started)


# ---- models -----------------------------------------------------------------------------------------

def test_a_valid_run_passes(tmp_path, models):
    preflight(load_config(write_config(tmp_path, models)), probe_servers=False)


def test_unsupported_student_architecture_names_key_architecture_and_supported_list(tmp_path, models):
    (line,) = preflight_errors(write_config(tmp_path, models, f"model.student={models['phi3']}"))
    assert line.startswith("model.student: architectures: 'Phi3ForCausalLM' is not supported; supported: ")
    assert "'Qwen3ForCausalLM'" in line and "'LlamaForCausalLM'" in line and models["phi3"] in line


def test_unsupported_megatron_teacher_architecture_is_refused_by_its_key(tmp_path, models):
    megatron = {"backend": "megatron", "model": models["phi3"]}
    path = write_config(tmp_path, models, "loss.support=null", teacher=megatron)
    (line,) = preflight_errors(path)
    assert line.startswith("teacher.teachers.0.model: architectures: 'Phi3ForCausalLM' is not supported")


def test_an_hf_teacher_needs_no_bridge(tmp_path, models):
    """transformers runs an hf teacher: any architecture it knows is fine."""
    hf = {"backend": "hf", "model": models["phi3"], "top_k": 8}
    preflight(load_config(write_config(tmp_path, models, teacher=hf)), probe_servers=False)


def test_layout_the_bridge_refuses_is_named(tmp_path, models):
    """intermediate_size 256 is not divisible by tp=3; heads 3/3 and layers pass validation."""
    student = hf_checkpoint(tmp_path, "three_heads", num_attention_heads=3, num_key_value_heads=3,
                            intermediate_size=256)
    teacher = {"backend": "hf", "model": models["teacher"], "top_k": 8}
    path = write_config(tmp_path, models, f"model.student={student}", "parallel.tp=3",
                        "parallel.world_size=3", "rollout.prompts_per_step=3", "parallel.global_batch_size=6",
                        "parallel.micro_batch_size=2", teacher=teacher)
    (line,) = preflight_errors(path)
    assert line.startswith("parallel.tp: 3 does not divide intermediate_size=256 of the model")
    assert "model.student" in line


def test_context_and_sequence_parallel_without_transformer_engine_name_the_key_and_te(tmp_path, models):
    """On CPU the local layer spec runs: neither CP nor sequence parallelism exists there."""
    student = hf_checkpoint(tmp_path, "two_kv_heads", num_attention_heads=4, num_key_value_heads=2)
    teacher = {"backend": "hf", "model": models["teacher"], "top_k": 8}
    path = write_config(tmp_path, models, f"model.student={student}", "parallel.cp=2", "parallel.tp=2",
                        "parallel.sequence_parallel=true", "parallel.world_size=4", "run.device=cpu",
                        teacher=teacher)
    cp, sp = preflight_errors(path)
    assert cp.startswith("parallel.cp: 2 needs Transformer Engine") and "the device is the CPU" in cp
    assert sp.startswith("parallel.sequence_parallel: needs Transformer Engine")


def test_recompute_modes_pass_the_checks(tmp_path, models):
    for mode in ("none", "selective", "full"):
        path = write_config(tmp_path, models, f"parallel.recompute={mode}")
        preflight(load_config(path), probe_servers=False)


def test_max_model_len_beyond_the_students_positions_is_refused(tmp_path, models):
    with pytest.raises(ConfigError, match=r"^rollout.max_model_len: 256 exceeds the max_position_embeddings "
                                          r"128 of model.student"):
        load_config(write_config(tmp_path, models, f"model.student={models['short']}"))
    short = write_config(tmp_path, models, f"model.student={models['short']}", "rollout.max_model_len=128")
    assert load_config(short).rollout.max_model_len == 128


@pytest.mark.parametrize("backend", ["vllm", "hf", "megatron"])
def test_max_model_len_beyond_an_in_process_teachers_positions_is_refused(tmp_path, models, backend):
    teacher = {"backend": backend, "model": models["short"]}
    extra = ["loss.support=null"] if backend == "megatron" else []
    with pytest.raises(ConfigError, match=r"^rollout.max_model_len: 256 exceeds the max_position_embeddings "
                                          r"128 of teacher.teachers.0.model"):
        load_config(write_config(tmp_path, models, *extra, teacher=teacher))


def test_teacher_top_k_beyond_its_vocabulary_is_refused(tmp_path, models):
    teacher = {"backend": "vllm", "model": models["teacher"], "top_k": 257}
    with pytest.raises(ConfigError, match=r"^teacher.teachers.0.top_k: 257 exceeds the vocabulary of 256 "):
        load_config(write_config(tmp_path, models, teacher=teacher))
    load_config(write_config(tmp_path, models, teacher={**teacher, "top_k": 256}))


def test_student_without_a_tokenizer_is_refused(tmp_path, models):
    bare = hf_checkpoint(tmp_path, "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(bare, name))
    (line,) = preflight_errors(write_config(tmp_path, models, f"model.student={bare}"))
    assert line.startswith(f"model.student: {bare!r} has no tokenizer")


def test_a_hub_id_whose_tokenizer_cannot_be_fetched_is_refused_by_its_key(tmp_path, models, monkeypatch,
                                                                          capsys):
    """A hub id (validation knows its shape) on a machine without the Hub: the run's first read, the
    student's tokenizer, names the key and says what to pass instead; nothing started, nothing written."""
    import huggingface_hub.constants

    from opkd_mcore.train.components import load_train_data

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network, no cache
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    path = write_config(tmp_path, models, "model.student=Qwen/Qwen3-0.6B")
    expected = "model.student: cannot load the tokenizer of 'Qwen/Qwen3-0.6B' from the Hugging Face Hub"
    with pytest.raises(ConfigError, match=expected):
        load_train_data(load_config(path))  # the run's own first step (`build_run`)
    assert launch.main(["--config", path, "--check"]) == 2
    assert f"opkd train: error: {expected}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")


# ---- output directory and data ------------------------------------------------------------------------

def test_output_dir_that_is_a_file_is_refused_by_key(tmp_path, models):
    (tmp_path / "run").write_text("not a directory")
    (line,) = preflight_errors(write_config(tmp_path, models))
    assert line.startswith(f"run.output_dir: {str(tmp_path / 'run')!r} is an existing file")


def test_resume_without_a_checkpoint_is_refused(tmp_path, models):
    (line,) = preflight_errors(write_config(tmp_path, models), resume=True)
    assert line.startswith("--resume: no complete checkpoint under")


def test_unreadable_data_file_is_refused(tmp_path, models):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": \n')
    (line,) = preflight_errors(write_config(tmp_path, models, f"data.train_path={data}"))
    assert line.startswith("data")


def test_every_problem_is_reported_at_once(tmp_path, models):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": \n')
    (tmp_path / "run").write_text("a file")
    errors = preflight_errors(write_config(tmp_path, models, f"model.student={models['phi3']}",
                                           f"data.train_path={data}"))
    assert [_section(e) for e in errors] == ["model", "data", "run"], errors


def _section(line: str) -> str:
    """The config section an error line names first (`data.train_path: ...` -> `data`)."""
    return line.split(":")[0].split(".")[0]


# ---- opkd train --check ------------------------------------------------------------------------------

def _listing(root) -> dict:
    """Every path under `root` with its size and modification time."""
    out = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            stat = os.stat(os.path.join(here, name))
            out[os.path.relpath(os.path.join(here, name), root)] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.mark.parametrize("controller", ["torchrun", "ray"])
def test_check_prints_the_resolved_config_and_exits_0_with_nothing_written(tmp_path, models, capsys,
                                                                          controller):
    path = write_config(tmp_path, models, f"controller.kind={controller}")
    before = _listing(tmp_path)
    assert launch.main(["--check", "--config", path, "optim.lr=5e-6"]) == 0
    assert _listing(tmp_path) == before
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == to_dict(load_config(path, ["optim.lr=5e-6"])) and printed["optim"]["lr"] == 5e-6


def test_check_exits_2_with_every_error_one_line_each(tmp_path, models, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": \n')
    (tmp_path / "run").write_text("a file")
    path = write_config(tmp_path, models, f"model.student={models['phi3']}", f"data.train_path={data}")
    before = _listing(tmp_path)
    assert launch.main(["--check", "--config", path]) == 2
    assert _listing(tmp_path) == before
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("opkd train: error: ") for line in lines), lines
    assert [_section(line.removeprefix("opkd train: error: ")) for line in lines] == ["model", "data", "run"]


def test_check_refuses_a_bad_config_with_its_key(tmp_path, models, capsys):
    assert launch.main(["--check", "--config", write_config(tmp_path, models), "optim.lr=fast"]) == 2
    assert capsys.readouterr().err.strip() == "opkd train: error: optim.lr: expected a number, got str 'fast'"


def test_a_missing_config_file_is_named_with_its_option(tmp_path, capsys):
    missing = str(tmp_path / "missing.yaml")
    assert launch.main(["--config", missing]) == 2
    assert capsys.readouterr().err.strip() == f"opkd train: error: --config: no such file {missing!r}"


@pytest.mark.parametrize("controller", ["torchrun", "ray"])
def test_a_run_is_checked_before_its_launcher_starts_anything(tmp_path, models, capsys, controller):
    """Without --check the same checks run first: an unsupported student never reaches an engine."""
    path = write_config(tmp_path, models, f"model.student={models['phi3']}", f"controller.kind={controller}")
    assert launch.main(["--config", path]) == 2
    assert "model.student: architectures: 'Phi3ForCausalLM' is not supported" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")
