"""A crafted Megatron checkpoint runs no code on `--resume`, `--export-only` or `opkd convert mcore-to-hf`.

One real checkpoint is written by the training save path (`train.checkpoint.save_checkpoint` of a
tiny Qwen3 `MegatronEngine` after one optimizer step). Each case copies it and plants a pickle whose
`__reduce__` creates a file, in one of the three places a `torch_dist` checkpoint is unpickled:
`.metadata`, a byte item of a `.distcp` file, `common.pt`. For each case the test shows

* that the payload is live: Megatron's own `dist_checkpointing.load` (what the loaders called
  before) creates the file;
* that the three load paths refuse the checkpoint with a ValueError naming the file and the
  refused global, and the file is not created: `train.checkpoint.load_checkpoint` (what both
  `--resume` and `--export-only` call, `train.components.build_run`; the Ray trainer's `load` too),
  a forward-only engine's `load_checkpoint`, and `opkd convert mcore-to-hf`.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil

import pytest
import torch

from opkd_mcore.models.checkpoint_metadata import METADATA_GLOBALS, check_dist_checkpoint, read_metadata
from opkd_mcore.models.convert import main as convert_main
from tests._dist import run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # the module's checkpoint: ~30 s on a 2-core CPU (Megatron start-up dominates)

CASES = ("metadata", "byte_item", "common")
REFUSED = "io.open"  # what the payload calls


class Payload:
    """Unpickles as `open(path, "w")`: creates `path`, the proof that a load ran the file's code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _load_metadata(engine_dir: str):
    with open(os.path.join(engine_dir, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own fresh save: trusted


def _append_item(engine_dir, metadata, index, info, obj) -> None:
    """Append `obj` (torch.save'd) to the shard that holds byte item `index`, and point the item there."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    path = os.path.join(engine_dir, info.relative_path)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    _dump_metadata(engine_dir, metadata)


def _dump_metadata(engine_dir: str, metadata) -> None:
    with open(os.path.join(engine_dir, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def plant(engine_dir: str, case: str, marker: str) -> None:
    """Put a payload that creates `marker` where `case` says, leaving the checkpoint loadable."""
    if case == "metadata":
        metadata = _load_metadata(engine_dir)
        metadata.payload = Payload(marker)
        _dump_metadata(engine_dir, metadata)
    elif case == "byte_item":  # replace the first `_extra_state` item by a torch-saved payload
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata = _load_metadata(engine_dir)
        index, info = next((i, s) for i, s in metadata.storage_data.items()
                           if "_extra_state" in i.fqn
                           and isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
        _append_item(engine_dir, metadata, index, info, [Payload(marker)])
    else:
        common = torch.load(os.path.join(engine_dir, "common.pt"), weights_only=True)
        common["payload"] = Payload(marker)
        torch.save(common, os.path.join(engine_dir, "common.pt"))


def _outcome(call, marker: str) -> dict:
    try:
        call()
        error = None
    except ValueError as err:
        error = str(err)
    return {"error": error, "ran": os.path.exists(marker)}


def _cases_worker(rank, world, hf_dir, root):
    """One rank: save a real checkpoint, then load each planted copy through every load path."""
    from megatron.core import dist_checkpointing

    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.models import build_model, load_hf_config
    from opkd_mcore.models.convert import model_sharded_state_dict
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.train.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from tests.test_engine import _ce_loss_fn, _global_loss_tokens, _micro_batches

    init_parallel(ParallelConfig(seed=1), device="cpu")
    try:
        engine = MegatronEngine(build_model(load_hf_config(hf_dir)), OptimSection(lr=1e-3))
        engine.train_step(_micro_batches(), _ce_loss_fn(_global_loss_tokens()))  # Adam state to save
        clean = save_checkpoint(os.path.join(root, "clean"), engine, TrainerState(step=3, weight_version=3),
                                "run: {}\n")
        result = {"clean": clean, "clean_step": load_checkpoint(clean, engine).step, "cases": {}}
        forward_only = MegatronEngine(build_model(load_hf_config(hf_dir)), optim=None)
        for case in CASES:
            ckpt = shutil.copytree(clean, os.path.join(root, case))
            engine_dir = os.path.join(ckpt, "engine")
            marker = os.path.join(root, f"ran_{case}")
            plant(engine_dir, case, marker)
            # Megatron reads common.pt weights-only unless this is set; set, its plain load runs code
            os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1" if case == "common" else "0"
            result["cases"][case] = {
                "engine_dir": engine_dir,
                "resume": _outcome(lambda: load_checkpoint(ckpt, engine), marker),
                "forward_only": _outcome(lambda: forward_only.load_checkpoint(engine_dir), marker),
            }
            try:  # what the loaders did before: Megatron's own load of the planted checkpoint
                dist_checkpointing.load(model_sharded_state_dict(forward_only.model), engine_dir)
            except Exception:  # noqa: BLE001  (the payload's return value breaks the load afterwards)
                pass
            result["cases"][case]["live"] = os.path.exists(marker)
            os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
        return result
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from opkd_mcore.models.tiny import save_tiny_hf_model

    hf_dir = save_tiny_hf_model(str(tmp_path_factory.mktemp("hf")), "qwen3", seed=1)
    root = str(tmp_path_factory.mktemp("ckpt"))
    (result,) = run_distributed(_cases_worker, 1, hf_dir, root)
    return result


def _file_of(case: str, engine_dir: str) -> str:
    return {"metadata": os.path.join(engine_dir, ".metadata"),
            "byte_item": os.path.join(engine_dir, "__0_"),  # the .distcp file, either of the two
            "common": os.path.join(engine_dir, "common.pt")}[case]


def test_a_clean_checkpoint_still_loads(planted):
    assert planted["clean_step"] == 3
    check_dist_checkpoint(os.path.join(planted["clean"], "engine"))


@pytest.mark.parametrize("case", CASES)
def test_the_planted_payload_is_live_under_megatrons_own_load(planted, case):
    assert planted["cases"][case]["live"], f"{case}: the payload did not run under a plain load"


@pytest.mark.parametrize("path", ["resume", "forward_only"])
@pytest.mark.parametrize("case", CASES)
def test_training_loads_refuse_the_payload_before_it_runs(planted, case, path):
    outcome = planted["cases"][case][path]
    assert outcome["error"] is not None, f"{case} via {path}: loaded without an error"
    assert _file_of(case, planted["cases"][case]["engine_dir"]) in outcome["error"]
    assert REFUSED in outcome["error"], outcome["error"]
    assert not outcome["ran"]


@pytest.mark.parametrize("case", CASES)
def test_convert_refuses_the_payload_before_it_runs(planted, tmp_path, capsys, case, monkeypatch):
    if case == "common":
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    engine_dir = str(shutil.copytree(os.path.join(planted["clean"], "engine"), tmp_path / "engine"))
    marker = str(tmp_path / "ran")
    plant(engine_dir, case, marker)
    assert convert_main(["mcore-to-hf", "--mcore-dir", engine_dir, "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert _file_of(case, engine_dir) in err and REFUSED in err, err
    assert not os.path.exists(marker) and not (tmp_path / "hf").exists()


def test_metadata_of_a_real_save_uses_only_admitted_globals(planted):
    """The admitted set covers every global a real save of the training path writes."""
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(os.path.join(planted["clean"], "engine", ".metadata"), "rb") as f:
        Recorder(f).load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert seen <= METADATA_GLOBALS, seen - METADATA_GLOBALS


def test_metadata_reader_refuses_any_other_global(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"x": os.getcwd}))
    with pytest.raises(ValueError, match=r"\.metadata: refusing to unpickle the global (posix|os)\.getcwd"):
        read_metadata(str(path))
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="expected the torch.distributed.checkpoint Metadata"):
        read_metadata(str(path))


def test_a_transformer_engine_extra_state_tensor_is_refused(planted, tmp_path):
    """TE unpickles a non-empty `_extra_state` tensor itself; a checkpoint of this project has none."""
    engine_dir = shutil.copytree(os.path.join(planted["clean"], "engine"), tmp_path / "engine")
    metadata = _load_metadata(engine_dir)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if "_extra_state" in i.fqn)
    pickled = pickle.dumps(Payload(str(tmp_path / "ran")))
    _append_item(engine_dir, metadata, index, info, [torch.frombuffer(bytearray(pickled), dtype=torch.uint8)])
    with pytest.raises(ValueError, match="extra-state tensor .* Transformer Engine would unpickle"):
        check_dist_checkpoint(str(engine_dir))
    assert not (tmp_path / "ran").exists()


def test_metadata_json_must_name_the_torch_dist_backend(planted, tmp_path):
    engine_dir = shutil.copytree(os.path.join(planted["clean"], "engine"), tmp_path / "engine")
    (engine_dir / "metadata.json").write_text('{"sharded_backend": "zarr", "common_backend": "torch"}')
    with pytest.raises(ValueError, match="metadata.json: sharded_backend is 'zarr', expected 'torch_dist'"):
        check_dist_checkpoint(str(engine_dir))
