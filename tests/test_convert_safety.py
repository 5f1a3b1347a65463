"""`opkd convert` never deletes or writes into its input, and `--force` replaces only its own output.

Every case runs the command line as a user types it (`opkd_mcore.models.convert.main`) and compares
the input directory's bytes before and after. The refusals come before any rank starts, so no case
converts anything.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from opkd_mcore.models.convert import FORMAT, MARKER_FILE, META_FILE, build_parser, check_output_dir
from opkd_mcore.models.convert import main as convert_main
from tests.test_train_checkpoint import _tree

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
    """A tiny HF checkpoint saved in shards with `model.safetensors.index.json`, as big models are."""
    import glob

    from transformers import AutoModelForCausalLM

    from opkd_mcore.models.tiny import save_tiny_hf_model

    out = str(tmp_path_factory.mktemp("hf"))
    save_tiny_hf_model(out, "qwen3", seed=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        os.remove(path)
    model.save_pretrained(out, max_shard_size="300KB")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    return out


@pytest.fixture
def hf_copy(sharded_hf, tmp_path):
    """A private copy: a case that fails on the old code deletes it, not the other cases' input."""
    return shutil.copytree(sharded_hf, tmp_path / "model")


def _fake_mcore(path) -> str:
    """A directory that passes `read_checkpoint_meta` (what the converter checked before this fix)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"format": FORMAT, "contents": ["model"], "params_dtype": "float32"}, f)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "common_backend": "torch"}, f)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"tensor bytes of a training run")
    return str(path)


def _refused(argv: list[str], capsys) -> str:
    assert convert_main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["same", "trailing_slash", "relative", "symlink"])
def test_hf_to_mcore_with_force_never_deletes_its_input(hf_copy, tmp_path, monkeypatch, capsys, spelling):
    before = _tree(hf_copy)
    out = {"same": str(hf_copy), "trailing_slash": f"{hf_copy}/", "relative": "model",
           "symlink": str(tmp_path / "link")}[spelling]
    if spelling == "symlink":
        os.symlink(hf_copy, out)
    monkeypatch.chdir(tmp_path)
    err = _refused(["hf-to-mcore", "--hf-dir", str(hf_copy), "--out", out, "--force"], capsys)
    assert "is the same directory as the input --hf-dir" in err
    assert out in err and os.path.realpath(hf_copy) in err
    assert _tree(hf_copy) == before


@pytest.mark.parametrize("force", [False, True])
def test_an_output_inside_the_input_is_refused(hf_copy, capsys, force):
    before = _tree(hf_copy)
    out = os.path.join(hf_copy, "mcore")
    err = _refused(["hf-to-mcore", "--hf-dir", str(hf_copy), "--out", out] + ["--force"] * force, capsys)
    assert f"out: {out!r}" in err and "is inside the input --hf-dir" in err
    assert _tree(hf_copy) == before  # nothing written into the input either


def test_an_output_containing_the_input_is_refused(hf_copy, tmp_path, capsys):
    before = _tree(tmp_path)
    err = _refused(["hf-to-mcore", "--hf-dir", str(hf_copy), "--out", str(tmp_path), "--force"], capsys)
    assert "contains the input --hf-dir" in err and str(hf_copy) in err
    assert _tree(tmp_path) == before


def test_mcore_to_hf_never_deletes_its_input_through_a_linked_parent(tmp_path, capsys):
    """The old check compared absolute paths: `link/ckpt` with `link -> .` passed it and --force
    removed the checkpoint (it holds opkd_checkpoint.json, which the old check took for its own)."""
    mcore = _fake_mcore(tmp_path / "ckpt")
    os.symlink(tmp_path, tmp_path / "link")
    before = _tree(mcore)
    out = str(tmp_path / "link" / "ckpt")
    err = _refused(["mcore-to-hf", "--mcore-dir", mcore, "--out", out, "--force"], capsys)
    assert "is the same directory as the input --mcore-dir" in err and out in err and mcore in err
    assert _tree(mcore) == before


def test_mcore_to_hf_refuses_an_output_inside_its_input(tmp_path, capsys):
    mcore = _fake_mcore(tmp_path / "ckpt")
    before = _tree(mcore)
    err = _refused(["mcore-to-hf", "--mcore-dir", mcore, "--out", os.path.join(mcore, "hf_export")], capsys)
    assert "is inside the input --mcore-dir" in err
    assert _tree(mcore) == before


def test_every_subcommand_refuses_an_output_that_is_its_input(sharded_hf, tmp_path, capsys):
    """Whatever subcommands there are: give every input flag and --out the same directory (one that
    would pass each input check), with --force; each is refused and the directory is untouched."""
    both = shutil.copytree(sharded_hf, tmp_path / "both")
    _fake_mcore(both)
    before = _tree(both)
    subcommands = build_parser()._subparsers._group_actions[0].choices
    assert set(subcommands) >= {"hf-to-mcore", "mcore-to-hf"}
    for name, sub in subcommands.items():
        inputs = [a.option_strings[0] for a in sub._actions if a.required and a.dest != "out"]
        assert inputs, f"{name}: no required input flag"
        argv = [name, *[x for flag in inputs for x in (flag, str(both))], "--out", str(both), "--force"]
        err = _refused(argv, capsys)
        assert "is the same directory as the input" in err, (name, err)
        assert _tree(both) == before, name


def test_force_never_replaces_an_hf_checkpoint_it_did_not_write(sharded_hf, hf_copy, capsys):
    """Any sharded HF checkpoint has model.safetensors.index.json, which the old check took for a
    conversion output of its own and deleted."""
    before = _tree(hf_copy)
    err = _refused(["hf-to-mcore", "--hf-dir", sharded_hf, "--out", str(hf_copy), "--force"], capsys)
    assert "not a checkpoint written by this tool" in err and MARKER_FILE in err
    assert _tree(hf_copy) == before


def test_force_never_replaces_a_training_checkpoint(sharded_hf, tmp_path, capsys):
    """A training run's engine checkpoint holds opkd_checkpoint.json but no marker: not the tool's."""
    engine_dir = _fake_mcore(tmp_path / "run" / "checkpoints" / "step_000010" / "engine")
    before = _tree(engine_dir)
    err = _refused(["hf-to-mcore", "--hf-dir", sharded_hf, "--out", engine_dir, "--force"], capsys)
    assert "not a checkpoint written by this tool" in err
    assert _tree(engine_dir) == before


def test_force_replaces_a_directory_with_the_marker_and_nothing_else(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / MARKER_FILE).write_text(json.dumps({"written_by": "opkd convert hf-to-mcore"}))
    (ours / "model-00001-of-00002.safetensors").write_bytes(b"old output")
    with pytest.raises(FileExistsError, match="pass --force to replace it"):
        check_output_dir(str(ours), force=False)
    assert (ours / MARKER_FILE).exists()
    check_output_dir(str(ours), force=True)
    assert not ours.exists()


def test_force_does_not_follow_a_symlink_to_a_marked_directory(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / MARKER_FILE).write_text("{}")
    os.symlink(ours, tmp_path / "link")
    with pytest.raises(FileExistsError, match="symbolic link"):
        check_output_dir(str(tmp_path / "link"), force=True)
    assert (ours / MARKER_FILE).exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("notes")
    with pytest.raises(FileExistsError, match="not a directory"):
        check_output_dir(str(tmp_path / "out"), force=True)
    assert (tmp_path / "out").read_text() == "notes"


@pytest.mark.parametrize("size", ["lots", "0", "0KB"])
def test_a_shard_size_that_is_no_size_is_refused_naming_the_option(tmp_path, capsys, size):
    with pytest.raises(SystemExit) as exit_:
        convert_main(["mcore-to-hf", "--mcore-dir", str(tmp_path), "--out", str(tmp_path / "out"),
                      "--max-shard-size", size])
    assert exit_.value.code == 2
    assert f"--max-shard-size: expected a size such as 4GB, 500MB or a byte count, got {size!r}" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shard_sizes_read_with_their_units():
    parse = build_parser().parse_args
    sizes = [parse(["mcore-to-hf", "--mcore-dir", "m", "--out", "o", "--max-shard-size", text]).max_shard_size
             for text in ("300KB", "1.5gb", "4096")]
    assert sizes == [300 << 10, int(1.5 * (1 << 30)), 4096]
    assert parse(["mcore-to-hf", "--mcore-dir", "m", "--out", "o"]).max_shard_size == 4 << 30
