"""Local HF checkpoints without weights: the config.json and tokenizer that config validation and the
start-up checks read (a test that loads no weights needs nothing more, and writes it in milliseconds)."""
from __future__ import annotations

import json
import os

from opkd_mcore.models.tiny import TinyModelShape, make_char_tokenizer, tiny_hf_config


def hf_checkpoint(root, name: str, *, family: str = "qwen3", architecture: str | None = None,
                  model_type: str | None = None, **shape) -> str:
    """`root/name` with a tiny `family` config (`shape`: TinyModelShape fields) and a character
    tokenizer; `architecture` / `model_type` replace the config's own (an unsupported model)."""
    path = os.path.join(str(root), name)
    tokenizer = make_char_tokenizer("0123456789+= ")
    tiny_hf_config(family, TinyModelShape(**shape), tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if architecture or model_type:
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            raw = json.load(f)
        raw["architectures"] = [architecture or raw["architectures"][0]]
        raw["model_type"] = model_type or raw["model_type"]
        with open(cfg_file, "w") as f:
            json.dump(raw, f)
    return path
