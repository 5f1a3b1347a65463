"""Checkpoint conversion HF <-> Megatron distributed checkpoint (`opkd convert`, tools/convert_ckpt.py).

    opkd convert hf-to-mcore --hf-dir IN --out OUT [--tp N] [--pp M] [--vpp V] [--ep E] [--etp T] [--force]
    opkd convert mcore-to-hf --mcore-dir IN --out OUT [--tp N] [--pp M] [--ep E] [--force]

A Megatron checkpoint written here (or by `MegatronEngine.save_checkpoint`) is a directory:

    OUT/                       megatron.core.dist_checkpointing files (metadata.json, *.distcp, common.pt)
    OUT/hf/                    the HF config, tokenizer and generation config it came from (no weights)
    OUT/opkd_checkpoint.json   what is inside (model / optimizer), dtype, the layout it was saved with
    OUT/.opkd_convert          (every output of `opkd convert`) which command wrote it, from what

The output directory is never an input, inside one or around one (paths resolved, symlinks
followed), and `--force` replaces only a directory holding `.opkd_convert`: an HF checkpoint, a
training run or anything else this tool did not write is never deleted. A Megatron checkpoint's
pickled files are read as data before Megatron loads them (`models.checkpoint_metadata`).

dist_checkpointing stores global tensors (routed experts under their global index), so a checkpoint
saved with one TP/PP/VPP/EP layout loads into any other; `mcore-to-hf` therefore defaults to a
single rank. With `--ep E` every EP rank reads (hf-to-mcore) or writes only its own experts.
Without a launcher the command spawns the ranks it needs (gloo, CPU by default), which join a store
this process serves on the loopback; under torchrun it uses the ranks it was given (the world size
must be a multiple of tp*pp; extra ranks are data-parallel replicas).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import traceback
from datetime import datetime, timedelta, timezone

import torch

from opkd_mcore.models import (
    TORCH_DTYPES,
    build_model,
    get_bridge,
    load_hf_config,
    load_hf_weights,
    save_hf_checkpoint,
)
from opkd_mcore.models.builder import layout_of, unwrap
from opkd_mcore.models.checkpoint_metadata import check_dist_checkpoint
from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel, is_rank0
from opkd_mcore.platform.tcp_store import serve_store

logger = logging.getLogger(__name__)

META_FILE = "opkd_checkpoint.json"
MARKER_FILE = ".opkd_convert"  # in every directory `opkd convert` writes: what --force may replace
HF_SUBDIR = "hf"
FORMAT = "opkd-mcore/megatron-dist-v1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
LOCALHOST = "127.0.0.1"  # spawned ranks of one machine: their store answers on the loopback only


# ----------------------------------------------------------------------------- checkpoint format
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_checkpoint_meta(ckpt_dir: str) -> dict:
    """`opkd_checkpoint.json` of a Megatron checkpoint; FileNotFoundError naming what is missing."""
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mcore_dir: {ckpt_dir!r} has no {META_FILE} (not a checkpoint written "
                                f"by opkd convert / MegatronEngine.save_checkpoint)")
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"mcore_dir: {ckpt_dir!r} has no metadata.json (incomplete "
                                f"dist_checkpointing save?)")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"mcore_dir: {path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def model_sharded_state_dict(model_chunks) -> dict:
    """One entry per VPP chunk; the tensor keys inside are global, so any layout can load them."""
    # the unwrapped GPTModel: a DDP wrapper would prefix every key with "module."
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def copy_hf_side_files(src_dir: str, dst_dir: str) -> None:
    """Config, tokenizer, generation config of an HF checkpoint (everything but the weights)."""
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(dst_dir, name))


def save_mcore_checkpoint(model_chunks, out_dir: str, *, hf_src_dir: str | None = None,
                          extra_state: dict | None = None, contents: tuple[str, ...] = ("model",),
                          num_steps: int = 0) -> None:
    """Collective: write `model_chunks` (+ `extra_state`, e.g. optimizer) as a dist checkpoint."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    layout = layout_of(model_chunks)
    if is_rank0():
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    state = model_sharded_state_dict(model_chunks)
    state.update(extra_state or {})
    dist_checkpointing.save(state, out_dir)
    if is_rank0():
        # written after the tensors so that a half-written directory is never mistaken for a checkpoint
        hf_dir = os.path.join(out_dir, HF_SUBDIR)
        if hf_src_dir is not None:
            copy_hf_side_files(hf_src_dir, hf_dir)
        else:
            layout.bridge.hf_config.save_pretrained(hf_dir)
        meta = {"format": FORMAT, "contents": list(contents), "num_steps": num_steps,
                "architecture": layout.bridge.hf_config.architectures[0],
                "params_dtype": dtype_name(unwrap(model_chunks[0]).config.params_dtype),
                "saved_with": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp,
                               **({"ep": layout.ep, "etp": layout.etp} if layout.bridge.is_moe else {})}}
        with open(os.path.join(out_dir, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
    dist.barrier()


def load_mcore_model(model_chunks, ckpt_dir: str, extra_sharded_state: dict | None = None) -> dict:
    """Collective: fill `model_chunks` (any layout) from a checkpoint; returns the loaded state
    (the model entries already applied), so callers can apply the extra entries they asked for."""
    from megatron.core import dist_checkpointing

    read_checkpoint_meta(ckpt_dir)
    check_dist_checkpoint(ckpt_dir)  # before Megatron unpickles anything of it
    request = model_sharded_state_dict(model_chunks)
    request.update(extra_sharded_state or {})
    loaded = dist_checkpointing.load(request, ckpt_dir)

    for i, chunk in enumerate(model_chunks):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    return loaded


# ----------------------------------------------------------------------------- the two directions
def _hf_params_dtype(hf_config) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    return TORCH_DTYPES.get(name, torch.float32)


def _progress(desc: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not is_rank0())


def hf_to_mcore_worker(hf_dir: str, out_dir: str, tp: int, pp: int, vpp: int | None, device: str,
                       ep: int = 1, etp: int | None = None) -> None:
    """Per rank: build the model for (tp, pp, vpp, ep), read owned HF slices, save a dist checkpoint."""
    init_parallel(ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp), device=device)
    try:
        hf_config = load_hf_config(hf_dir)
        with _progress("hf-to-mcore", 3) as bar:
            chunks = build_model(hf_config, params_dtype=_hf_params_dtype(hf_config))
            bar.update()
            load_hf_weights(chunks, hf_dir)
            bar.update()
            mark_output_dir(out_dir, "hf-to-mcore", {"hf_dir": hf_dir})
            save_mcore_checkpoint(chunks, out_dir, hf_src_dir=hf_dir)
            bar.update()
    finally:
        destroy_parallel()


def mcore_to_hf_worker(mcore_dir: str, out_dir: str, tp: int, pp: int, vpp: int | None, device: str,
                       max_shard_bytes: int, ep: int = 1, etp: int | None = None) -> None:
    """Per rank: build the model for (tp, pp, vpp, ep), load the dist checkpoint, write HF safetensors."""
    meta = read_checkpoint_meta(mcore_dir)
    hf_src = os.path.join(mcore_dir, HF_SUBDIR)
    init_parallel(ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp), device=device)
    try:
        chunks = build_model(load_hf_config(hf_src), params_dtype=TORCH_DTYPES[meta["params_dtype"]])
        load_mcore_model(chunks, mcore_dir)
        # the export is staged next to out_dir and swapped in whole (no half-written output is ever
        # there), so the marker goes into the finished directory
        save_hf_checkpoint(chunks, out_dir, src_hf_dir=hf_src, max_shard_bytes=max_shard_bytes,
                           progress=is_rank0())
        mark_output_dir(out_dir, "mcore-to-hf", {"mcore_dir": mcore_dir})
    finally:
        destroy_parallel()


# ----------------------------------------------------------------------------- checks + launching
def mark_output_dir(out_dir: str, command: str, inputs: dict[str, str]) -> None:
    """Collective: rank 0 writes this tool's marker into `out_dir` (creating it), which `--force`
    looks for. hf-to-mcore marks before any rank writes data, so a conversion that died half-way can
    be replaced."""
    import torch.distributed as dist

    if is_rank0():
        os.makedirs(out_dir, exist_ok=True)
        marker = {"written_by": f"opkd convert {command}", "inputs": inputs,
                  "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with open(os.path.join(out_dir, MARKER_FILE), "w") as f:
            json.dump(marker, f, indent=2)
    dist.barrier()


def check_disjoint(out_dir: str, inputs: dict[str, str]) -> None:
    """Refuse an output equal to, inside or around an input (`inputs`: flag -> directory), whatever
    the spelling: relative paths and symlinks are resolved."""
    out = os.path.realpath(out_dir)
    for flag, path in inputs.items():
        real = os.path.realpath(path)
        if out == real:
            relation = "is the same directory as"
        elif os.path.commonpath([out, real]) == real:
            relation = "is inside"
        elif os.path.commonpath([out, real]) == out:
            relation = "contains"
        else:
            continue
        raise ValueError(f"out: {out_dir!r} ({out}) {relation} the input {flag} {path!r} ({real}); "
                         f"write the output to a directory of its own, outside every input")


def check_output_dir(out_dir: str, force: bool, marker: str = MARKER_FILE) -> None:
    """Refuse to overwrite; `force` replaces only a directory this tool wrote (it holds `marker`, the
    file the tool writes first: `opkd convert`'s, or `tools/make_model.py`'s)."""
    if not os.path.exists(out_dir) or (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        return
    if not os.path.isdir(out_dir):
        raise FileExistsError(f"out: {out_dir!r} exists and is not a directory")
    ours = os.path.isfile(os.path.join(out_dir, marker))
    if not force:
        hint = ("pass --force to replace it" if ours else
                f"it is not a checkpoint written by this tool (no {marker}), choose another --out")
        raise FileExistsError(f"out: {out_dir!r} already exists and is not empty; {hint}")
    if not ours:
        raise FileExistsError(f"out: {out_dir!r} is not a checkpoint written by this tool (it has no "
                              f"{marker} marker); --force replaces only those, and never an HF "
                              f"checkpoint or a directory it did not write: remove it yourself")
    if os.path.islink(out_dir):
        raise FileExistsError(f"out: {out_dir!r} is a symbolic link; --force replaces only a directory "
                              f"itself, give the path it points to ({os.path.realpath(out_dir)})")
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank gets here; one deletes
        shutil.rmtree(out_dir)


def check_hf_input(hf_dir: str, tp: int, pp: int, vpp: int | None, ep: int = 1,
                   etp: int | None = None) -> None:
    """Everything that can be checked before ranks start: files, architecture, divisibility."""
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"hf_dir: {hf_dir!r} is not a directory")
    hf_config = load_hf_config(hf_dir)  # FileNotFoundError naming config.json when it is missing
    has_weights = any(os.path.isfile(os.path.join(hf_dir, n))
                      for n in ("model.safetensors", "model.safetensors.index.json"))
    if not has_weights:
        raise FileNotFoundError(f"hf_dir: {hf_dir!r} has neither model.safetensors nor "
                                f"model.safetensors.index.json")
    bridge = get_bridge(hf_config)
    if ep != 1 and not bridge.is_moe:
        raise ValueError(f"ep: {ep} needs an MoE model; {hf_config.architectures[0]} has no experts")
    bridge.check_parallel(tp, pp, vpp, ep, etp)


def _check_layout(tp: int, pp: int, vpp: int | None, ep: int = 1, etp: int | None = None) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp or 1)):
        if value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value}")
    if vpp is not None and (vpp < 1 or (vpp > 1 and pp < 2)):
        raise ValueError(f"vpp: expected None, or an int >= 1 with pp >= 2 when > 1; got vpp={vpp}, pp={pp}")


def _spawned_rank(rank: int, world_size: int, port: int, fn, args, errors) -> None:
    # the parent serves the store: every rank joins it as a client, as torchrun's ranks join the store
    # of their agent (torch's env:// rendezvous reads TORCHELASTIC_USE_AGENT_STORE)
    os.environ.update(MASTER_ADDR=LOCALHOST, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        fn(*args)
    except BaseException:  # hand the traceback to the parent, which reports it once
        errors.put((rank, traceback.format_exc()))
        sys.exit(1)


def conversion_world_size(tp: int, pp: int, ep: int, etp: int | None) -> int:
    """Fewest ranks holding the layout: Megatron carves both tp x dp and etp x ep x edp from them."""
    dense, experts = tp * pp, (tp if etp is None else etp) * ep * pp
    return dense * experts // math.gcd(dense, experts)


def launch(fn, world_size: int, *args) -> None:
    """Run `fn(*args)` on `world_size` ranks: in place under a launcher, else spawned locally."""
    import torch.multiprocessing as mp

    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world % world_size:
            raise ValueError(f"WORLD_SIZE: {world} ranks were launched but the layout needs a "
                             f"multiple of {world_size} (lcm of tp*pp and etp*ep*pp)")
        fn(*args)
        return
    # served here, on a socket bound before any rank is told the port: nothing can take it in between
    store = serve_store(LOCALHOST, world_size, timedelta(minutes=ParallelConfig().timeout_minutes))
    port = store.port
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawned_rank, args=(r, world_size, port, fn, args, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        detail = errors.get() if not errors.empty() else (None, "no traceback (killed?)")
        raise RuntimeError(f"rank {detail[0]} of {world_size} failed:\n{detail[1]}")


# ----------------------------------------------------------------------------- API + CLI
def convert_hf_to_mcore(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                        force: bool = False, device: str = "cpu", ep: int = 1,
                        etp: int | None = None) -> None:
    """HF safetensors checkpoint -> Megatron dist checkpoint (+ HF config/tokenizer in OUT/hf)."""
    _check_layout(tp, pp, vpp, ep, etp)
    check_disjoint(out_dir, {"--hf-dir": hf_dir})
    check_hf_input(hf_dir, tp, pp, vpp, ep, etp)
    check_output_dir(out_dir, force)
    launch(hf_to_mcore_worker, conversion_world_size(tp, pp, ep, etp), os.path.abspath(hf_dir),
           os.path.abspath(out_dir), tp, pp, vpp, device, ep, etp)


def convert_mcore_to_hf(mcore_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                        force: bool = False, device: str = "cpu", max_shard_bytes: int = 4 << 30,
                        ep: int = 1, etp: int | None = None) -> None:
    """Megatron dist checkpoint -> HF sharded safetensors + index + config + tokenizer."""
    _check_layout(tp, pp, vpp, ep, etp)
    check_disjoint(out_dir, {"--mcore-dir": mcore_dir})
    read_checkpoint_meta(mcore_dir)
    check_dist_checkpoint(mcore_dir)  # here too: a refused file is a one-line error before ranks start
    check_output_dir(out_dir, force)
    launch(mcore_to_hf_worker, conversion_world_size(tp, pp, ep, etp), os.path.abspath(mcore_dir),
           os.path.abspath(out_dir), tp, pp, vpp, device, max_shard_bytes, ep, etp)


def shard_size(text: str) -> int:
    """argparse type of --max-shard-size: a byte count, or a number with KB / MB / GB (`4GB`, `500MB`)."""
    number, scale = text.strip().upper(), 1
    for suffix, unit in {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}.items():
        if number.endswith(suffix):
            number, scale = number[:-len(suffix)], unit
            break
    try:
        size = int(float(number) * scale)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GB, 500MB or a byte count, got {text!r}")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opkd convert", description="Convert checkpoints HF <-> Megatron.")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config + safetensors)")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    to_hf.add_argument("--mcore-dir", required=True, help="checkpoint written by hf-to-mcore or training")
    to_hf.add_argument("--max-shard-size", type=shard_size, default="4GB",
                       help="largest safetensors file (e.g. 4GB, 500MB)")
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True, help="output directory: new or empty (or see --force); never "
                       "an input, inside one or around one")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks used for the conversion")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks used for the conversion")
        p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
        p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models)")
        p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: tp)")
        p.add_argument("--device", default="cpu", help="cpu (gloo) or an accelerator type")
        p.add_argument("--force", action="store_true",
                       help=f"replace an output an earlier opkd convert wrote (it holds {MARKER_FILE}); any "
                       "other directory is refused, never deleted")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        if args.direction == "hf-to-mcore":
            convert_hf_to_mcore(args.hf_dir, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp,
                                force=args.force, device=args.device, ep=args.ep, etp=args.etp)
        else:
            convert_mcore_to_hf(args.mcore_dir, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp,
                                force=args.force, device=args.device,
                                max_shard_bytes=args.max_shard_size, ep=args.ep,
                                etp=args.etp)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"opkd convert: error: {err}", file=sys.stderr)
        return 2
    if is_rank0():
        print(f"opkd convert: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
