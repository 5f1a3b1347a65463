"""Convert checkpoints between Hugging Face safetensors and Megatron distributed checkpoints.

    python tools/convert_ckpt.py hf-to-mcore --hf-dir IN --out OUT --tp N --pp M [--vpp V] [--ep E] [--force]
    python tools/convert_ckpt.py mcore-to-hf --mcore-dir IN --out OUT [--force]

Same as `opkd convert ...`. Runs as a plain script (spawns the ranks it needs over gloo on the CPU)
or under torchrun. The output is never an input, inside one or around one; `--force` replaces only
a directory an earlier conversion wrote (it holds `.opkd_convert`), never anything else. The logic
lives in `opkd_mcore.models.convert`.
"""
import sys

from opkd_mcore.models.convert import main

if __name__ == "__main__":
    sys.exit(main())
