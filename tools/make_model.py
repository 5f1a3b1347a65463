"""Write a random-weight Hugging Face checkpoint of a real model shape (nothing is downloaded).

The GPU benchmarks and the GPU `opkd train` runs use these: a Qwen3-shaped model (dense, or the
Qwen3-MoE of qwen3-30b-a3b) with the project's character tokenizer (the vocabulary rows are padded to
the shape's size), in bf16 or fp32. `--layers N`: the same width with N decoder layers.

    python tools/make_model.py --shape qwen3-0.6b --out /tmp/models/student --dtype bf16
    python tools/make_model.py --shape qwen3-1.7b --out /tmp/models/teacher --seed 2
    python tools/make_model.py --shape qwen3-30b-a3b --layers 8 --out /tmp/models/moe8 --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opkd_mcore.data import ALPHABET  # noqa: E402
from opkd_mcore.models.convert import check_output_dir  # noqa: E402
from opkd_mcore.models.tiny import NAMED_SHAPES, named_shape, save_tiny_hf_model  # noqa: E402

MARKER_FILE = ".opkd_make_model"  # written first into --out: what --force may replace (a half-written one too)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=sorted(NAMED_SHAPES), help="model shape")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weight dtype")
    p.add_argument("--seed", type=int, default=1, help="init seed")
    p.add_argument("--init-std", type=float, default=0.02, help="init standard deviation")
    p.add_argument("--device", default="cpu", help="where the random init runs (cuda: seconds for 8B)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers instead of the shape's own (e.g. 8 of Qwen3-30B-A3B's 48)")
    p.add_argument("--force", action="store_true",
                   help=f"replace an --out this tool wrote (it holds {MARKER_FILE}); any other non-empty "
                        "directory is refused, never deleted")
    args = p.parse_args(argv)
    try:
        family, shape = named_shape(args.shape, args.layers)
        check_output_dir(args.out, args.force, marker=MARKER_FILE)
    except (ValueError, FileExistsError) as err:
        p.error(str(err))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, MARKER_FILE), "w") as f:
        f.write(f"{args.shape}\n")
    start = time.perf_counter()
    save_tiny_hf_model(args.out, family, shape, seed=args.seed, alphabet=ALPHABET,
                       init_std=args.init_std, dtype=DTYPES[args.dtype], device=args.device)
    print(f"wrote {args.shape} ({family}, {shape.num_layers} layers, {args.dtype}) to {args.out} "
          f"in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
