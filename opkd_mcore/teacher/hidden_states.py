"""A served teacher that returns final-norm hidden states: exact dense KD at H_t x 2 bytes per token.

vLLM runs a causal LM as a *pooling* model without any fork or plugin: `runner="pooling"`,
`convert="embed"` drops the LM head, and the pooler settings below return, for every prompt
position, the decoder's final-norm hidden state unchanged (no normalisation, no activation) — the
vector the LM head would multiply (checked against `transformers`' `last_hidden_state`). The
stock OpenAI server serves the same through `/pooling` with `encoding_format: bytes` and
`embed_dtype: bfloat16`, i.e. raw bf16 on the wire plus a JSON `metadata` header per response.

The trainer holds the teacher's output weight itself, as this TP rank's shard
(`load_output_weight_shard`), and the fused LM-head loss forms the teacher's logits tile by tile
(`opkd_mcore.losses.linear_kd_loss` with a `HiddenTeacher`).
"""
from __future__ import annotations

import json
import math
import os

import torch

from opkd_mcore.losses.teacher_outputs import HiddenTeacher
from opkd_mcore.models.weights import _SafetensorsIndex
from opkd_mcore.teacher.base import MalformedTeacherOutputError

# vLLM pooler settings: every position's final-norm hidden state, as is
POOLER_CONFIG = {"task": "token_embed", "tok_pooling_type": "ALL", "use_activation": False}
POOLING_TASK = "token_embed"
WIRE_DTYPE = "bfloat16"


def server_args() -> list[str]:
    """vLLM OpenAI-server flags that make it answer `/pooling` with hidden states."""
    return ["--runner", "pooling", "--convert", "embed", "--pooler-config", json.dumps(POOLER_CONFIG)]


def engine_kwargs() -> dict:
    """`vllm.LLM` keywords for the same, in process."""
    from vllm.config import PoolerConfig

    return dict(runner="pooling", convert="embed", pooler_config=PoolerConfig(**POOLER_CONFIG))


def pooled_input(seq: list[int]) -> list[int]:
    """What a pooling engine is sent for `seq`: all but its last token, whose position scores nothing.
    A request as long as the engine's context would never finish prefilling on vLLM 0.26 (its
    scheduler keeps a position free for a sampled token even for pooling requests), so a sample that
    fills the rollout's context is scored by an engine of that context this way."""
    return seq[:-1]


def rows_from_states(seq: list[int], states: torch.Tensor, where: str) -> HiddenTeacher:
    """Hidden states of the positions of `pooled_input(seq)` `[L-1, H_t]` -> the rows that score
    tokens 1..L-1, in bf16: row t is position t's state, which the LM head turns into the distribution
    of token t+1. The output-weight shard is attached by the trainer."""
    if not isinstance(states, torch.Tensor) or states.dim() != 2 or states.shape[0] != len(seq) - 1:
        got = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise MalformedTeacherOutputError(f"{where}: expected hidden states [{len(seq) - 1}, H] (the "
                                          f"{len(seq)}-token sequence without its last token), got {got}")
    if torch.isnan(states).any():
        raise MalformedTeacherOutputError(f"{where}: NaN in the teacher's hidden states")
    return HiddenTeacher(hidden=states.to(torch.bfloat16).contiguous(), weight=None)


def decode_bytes_response(body: bytes, metadata: str, count: int, where: str) -> list[torch.Tensor]:
    """A vLLM `/pooling` response with `encoding_format: bytes` -> one tensor per input, in order."""
    try:
        items = sorted(json.loads(metadata)["data"], key=lambda item: item["index"])
        out = []
        for item in items:
            dtype = getattr(torch, item["embed_dtype"])
            if item["endianness"] not in ("native", "little"):
                raise ValueError(f"endianness {item['endianness']!r}")
            raw = bytearray(body[item["start"]:item["end"]])
            shape = tuple(item["shape"])
            if len(raw) != math.prod(shape) * torch.tensor([], dtype=dtype).element_size():
                raise ValueError(f"{len(raw)} bytes for shape {shape}")
            out.append(torch.frombuffer(raw, dtype=dtype).view(shape))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise MalformedTeacherOutputError(f"{where}: unreadable hidden-state response ({err!r})") from err
    if len(out) != count:
        raise MalformedTeacherOutputError(f"{where}: expected {count} hidden-state arrays, got {len(out)}")
    return out


def output_weight_name(model_dir: str) -> tuple[str, int]:
    """(checkpoint name of the output weight: the embedding's when tied, vocabulary size)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    tied = bool(config.get("tie_word_embeddings", False))
    return ("model.embed_tokens.weight" if tied else "lm_head.weight"), int(config["vocab_size"])


@torch.no_grad()
def load_output_weight_shard(model_dir: str, padded_vocab: int, tp_rank: int, tp_size: int,
                             dtype: torch.dtype, device=None) -> torch.Tensor:
    """This TP rank's rows `[padded_vocab / tp, H_t]` of the teacher's output weight (the embedding
    when tied), read from its HF safetensors checkpoint; rows past the checkpoint's are 0 (the loss
    masks them as vocabulary padding)."""
    if padded_vocab % tp_size:
        raise ValueError(f"padded_vocab: {padded_vocab} is not divisible by the TP size {tp_size}")
    name, _ = output_weight_name(model_dir)
    sliced = _SafetensorsIndex(model_dir).slice(name)
    rows, hidden = sliced.get_shape()
    v_local = padded_vocab // tp_size
    lo, hi = tp_rank * v_local, min(rows, (tp_rank + 1) * v_local)
    shard = torch.zeros(v_local, hidden, dtype=dtype)
    if hi > lo:
        shard[:hi - lo] = sliced[lo:hi].to(dtype)
    return shard if device is None else shard.to(device)
