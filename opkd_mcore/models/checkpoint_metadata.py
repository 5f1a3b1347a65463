"""Read a Megatron distributed checkpoint's pickled files as data, before torch or Megatron reads them.

A `torch_dist` checkpoint holds three kinds of pickles that its readers load without restriction:

* `.metadata` (torch.distributed.checkpoint's `FileSystemReader.read_metadata`: `pickle.load`);
* the byte items inside the `*.distcp` files (non-tensor state such as `_extra_state` and the
  optimizer's param groups: `DefaultLoadPlanner.load_bytes` uses `torch.load(weights_only=False)`);
* `common.pt` (Megatron: `torch.load` with torch's default, which the environment variable
  `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` turns into an unrestricted load).

Unpickling runs whatever callable the file names, so a crafted checkpoint would run code on
`opkd train --resume`, `--export-only` and `opkd convert mcore-to-hf`. `check_dist_checkpoint`
reads each of them first, the way `torch.load(weights_only=True)` does: `.metadata` through an
unpickler that admits only the classes torch's checkpoint metadata is made of (`METADATA_GLOBALS`:
the globals recorded while unpickling real saves of this project, dense and MoE, with and without
the distributed optimizer, plus the sibling dataclasses and enums of the same torch modules), the
byte items and `common.pt` through torch's weights-only unpickler. Anything else is a `ValueError`
naming the file and the refused global, and nothing of the file has run.

Transformer Engine layers unpickle a non-empty `_extra_state` tensor themselves (FP8 scaling state);
this project writes none, so such a tensor is refused too. `metadata.json` must name the
`torch_dist` / `torch` backends: another backend would read the files with other loaders.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}

_DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = frozenset(
    [(f"{_DCP}.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", name) for name in (
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
        "TensorWriteData", "BytesIOWriteData")]
    + [(f"{_DCP}.filesystem", "_StorageInfo"),
       ("torch", "Size"), ("torch.serialization", "_get_layout"),  # layouts travel by name
       ("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")]
    + [("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)]
)


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only the classes of `METADATA_GLOBALS` (torch's checkpoint metadata)."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise ValueError(f"{self.path}: refusing to unpickle the global {module}.{name}: a "
                             f"checkpoint's {METADATA_FILE} holds only torch.distributed.checkpoint "
                             "metadata, so no checkpoint save wrote this file (crafted, or damaged)")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise ValueError(f"{self.path}: refusing a persistent id in checkpoint metadata ({pid!r})")


def read_metadata(path: str) -> Metadata:
    """A `.metadata` file's content, built from the admitted classes only (ValueError otherwise)."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError) as err:
            raise ValueError(f"{path}: not readable as checkpoint metadata "
                             f"({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: holds a {type(metadata).__name__}, expected the "
                         f"torch.distributed.checkpoint Metadata of a checkpoint")
    return metadata


def _refused_global(err: Exception) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return f"the global {found.group(1)}" if found else str(err).splitlines()[0]


def load_weights_only(data: bytes | str, where: str):
    """`torch.load(weights_only=True)` of a file or of bytes; ValueError naming `where` and the
    global torch refused. The explicit flag holds whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{where}: refusing to unpickle {_refused_global(err)} (only tensors and "
                         f"plain data are loaded from a checkpoint)") from None
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"{where}: not readable as a torch-saved object ({err})") from None


def _check_extra_state(value, where: str) -> None:
    """Transformer Engine unpickles a non-empty `_extra_state` tensor (FP8 state) without restriction."""
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_extra_state(item, where)
    elif isinstance(value, dict):
        for item in value.values():
            _check_extra_state(item, where)
    elif isinstance(value, torch.Tensor) and value.numel():
        raise ValueError(f"{where}: holds a non-empty extra-state tensor ({value.numel()} {value.dtype} "
                         "values), which Transformer Engine would unpickle; checkpoints of this project "
                         "hold no FP8 state, refusing it")


def _read_item(ckpt_dir: str, index, info) -> tuple[bytes, str]:
    """The bytes of one stored item, and how to name it in an error."""
    name = getattr(info, "relative_path", None)
    where = f"{os.path.join(ckpt_dir, str(name))} (item {index.fqn!r})"
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        raise ValueError(f"{where}: a checkpoint's items live in files of its own directory, got the "
                         f"path {name!r}")
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"{where}: stored through stream transforms {info.transform_descriptors}, "
                         "which checkpoints of this project never use")
    with open(os.path.join(ckpt_dir, name), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length), f"{where} at byte {info.offset}"


def check_byte_items(ckpt_dir: str, metadata: Metadata) -> None:
    """Load every byte item of the checkpoint's `*.distcp` files weights-only (torch's planner would
    load them with `weights_only=False`)."""
    items, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(items, dict) or not isinstance(storage, dict):
        raise ValueError(f"{os.path.join(ckpt_dir, METADATA_FILE)}: expected dicts of items and of their "
                         f"storage, got {type(items).__name__} and {type(storage).__name__}")
    for index, info in storage.items():
        if isinstance(items.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            data, where = _read_item(ckpt_dir, index, info)
            value = load_weights_only(data, where)
            if "_extra_state" in index.fqn:
                _check_extra_state(value, where)


def check_backends(ckpt_dir: str) -> None:
    path = os.path.join(ckpt_dir, "metadata.json")
    with open(path) as f:
        config = json.load(f)
    for key, expected in BACKENDS.items():
        if config.get(key) != expected:
            raise ValueError(f"{path}: {key} is {config.get(key)!r}, expected {expected!r} (the only "
                             "format this project writes and reads)")


def check_dist_checkpoint(ckpt_dir: str) -> None:
    """Refuse (ValueError naming the file) a checkpoint whose pickled files hold anything but
    checkpoint metadata, tensors and plain data; call it before `dist_checkpointing.load`."""
    check_backends(ckpt_dir)
    metadata_files = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(METADATA_FILE))
    if METADATA_FILE not in metadata_files:
        raise ValueError(f"{ckpt_dir}: has no {METADATA_FILE} (an incomplete torch_dist checkpoint)")
    for name in metadata_files:
        metadata = read_metadata(os.path.join(ckpt_dir, name))
        if name == METADATA_FILE:
            check_byte_items(ckpt_dir, metadata)
    common = os.path.join(ckpt_dir, COMMON_FILE)
    if os.path.exists(common):
        load_weights_only(common, common)
