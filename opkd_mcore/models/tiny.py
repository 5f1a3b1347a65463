"""Tiny Hugging Face checkpoints made locally (random weights, nothing downloaded).

Used by the tests of every part and by `opkd demo`. Sizes respect what the engines need on a
CPU: vLLM's CPU attention rejects head_dim < 64, so the default head_dim is 64.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import torch

FAMILY_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}

# MoE families: 8 experts, top-2 (overridable through TinyModelShape.extra)
MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),  # expert size: intermediate_size
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, norm_topk_prob=False),
}
# Router weights get this std instead of init_std: with near-zero router logits, top-k picks between
# near-ties, and two correct implementations that round differently would pick different experts
ROUTER_INIT_STD = 0.5

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


@dataclass
class TinyModelShape:
    """Dimensions of a tiny test/demo model."""

    vocab_size: int = 256  # padded up to hold the tokenizer if it is larger
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # family-specific config overrides


# Real model shapes (random weights: nothing can be downloaded where the benchmarks run), from the
# checkpoints' config.json. Qwen3's RoPE base is 1e6 (transformers' default is 1e4); RMSNorm eps 1e-6
# and max_position_embeddings 40960 are the defaults here and there.
_QWEN3_ROPE = dict(rope_theta=1_000_000.0)
NAMED_SHAPES = {
    "qwen3-0.6b": TinyModelShape(vocab_size=151936, hidden_size=1024, num_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                 max_position_embeddings=40960, tie_word_embeddings=True, extra=_QWEN3_ROPE),
    "qwen3-1.7b": TinyModelShape(vocab_size=151936, hidden_size=2048, num_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                                 max_position_embeddings=40960, tie_word_embeddings=True, extra=_QWEN3_ROPE),
    "qwen3-4b": TinyModelShape(vocab_size=151936, hidden_size=2560, num_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                               max_position_embeddings=40960, tie_word_embeddings=True, extra=_QWEN3_ROPE),
    "qwen3-8b": TinyModelShape(vocab_size=151936, hidden_size=4096, num_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                               max_position_embeddings=40960, extra=_QWEN3_ROPE),
    "qwen3-14b": TinyModelShape(vocab_size=151936, hidden_size=5120, num_layers=40, num_attention_heads=40,
                                num_key_value_heads=8, head_dim=128, intermediate_size=17408,
                                max_position_embeddings=40960, extra=_QWEN3_ROPE),
    "qwen3-32b": TinyModelShape(vocab_size=151936, hidden_size=5120, num_layers=64, num_attention_heads=64,
                                num_key_value_heads=8, head_dim=128, intermediate_size=25600,
                                max_position_embeddings=40960, extra=_QWEN3_ROPE),
    # Qwen3-30B-A3B (HF config.json of Qwen/Qwen3-30B-A3B): every layer an MoE block of 128 experts,
    # top-8 with the top-k weights renormalised; intermediate_size is the config's, unused (no dense
    # layer). `named_shape(..., layers=8)` gives the 8-layer variant the GPU lane trains and syncs.
    "qwen3-30b-a3b": TinyModelShape(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, max_position_embeddings=40960,
        extra=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                   rope_theta=1000000.0, rms_norm_eps=1e-6)),
}
# The family of a named shape that is not a dense Qwen3
NAMED_SHAPE_FAMILIES = {"qwen3-30b-a3b": "qwen3_moe"}


def named_shape(name: str, layers: int | None = None) -> tuple[str, TinyModelShape]:
    """(family, shape) of a name in NAMED_SHAPES, with `layers` decoder layers instead of the model's
    own when given (a shorter model of the same width: a benchmark that fits fewer GPUs)."""
    if name not in NAMED_SHAPES:
        raise ValueError(f"shape: expected one of {sorted(NAMED_SHAPES)}, got {name!r}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers: expected a positive number of decoder layers, got {layers}")
    shape = NAMED_SHAPES[name]
    if layers is not None:
        shape = replace(shape, num_layers=layers, extra=dict(shape.extra))
    return NAMED_SHAPE_FAMILIES.get(name, "qwen3"), shape

def make_char_tokenizer(alphabet: str):
    """A character-level `PreTrainedTokenizerFast`: ids 0..2 are <pad>, <bos>, <eos>, then `alphabet`.

    It puts <bos> before every text it encodes (`tokenizer(text)`, and vLLM's text prompts), as
    Llama-style tokenizers do: the saved checkpoint then gets the prompts it was trained on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    bos = SPECIAL_TOKENS[1]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<pad>", clean_up_tokenization_spaces=False,
    )


def tiny_hf_config(family: str, shape: TinyModelShape, tokenizer=None):
    """A `transformers` config of the family with the given tiny shape."""
    from transformers import AutoConfig

    if family not in FAMILY_ARCHITECTURES:
        raise ValueError(f"family: expected one of {sorted(FAMILY_ARCHITECTURES)}, got {family!r}")
    vocab = max(shape.vocab_size, len(tokenizer) if tokenizer is not None else 0)
    ids = {}
    if tokenizer is not None:
        ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return AutoConfig.for_model(
        family, vocab_size=vocab, hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings, torch_dtype="float32",
        architectures=[FAMILY_ARCHITECTURES[family]], **ids,
        **{**MOE_DEFAULTS.get(family, {}), **shape.extra},
    )


def save_tiny_hf_model(out_dir: str, family: str = "qwen3", shape: TinyModelShape | None = None,
                       seed: int = 0, alphabet: str = "0123456789+= ", init_std: float = 0.02,
                       dtype: torch.dtype = torch.float32, device: str = "cpu", tokenizer=None):
    """Write a random-weight HF checkpoint (safetensors + config + char tokenizer) to `out_dir`
    (`device`: where the random init runs; an accelerator makes an 8B-shaped model in seconds).
    `tokenizer`: a fast tokenizer to save instead of the char tokenizer of `alphabet`."""
    from transformers import AutoModelForCausalLM

    shape = shape or TinyModelShape()
    tokenizer = tokenizer if tokenizer is not None else make_char_tokenizer(alphabet)
    config = tiny_hf_config(family, shape, tokenizer)
    config.initializer_range = init_std
    config.torch_dtype = dtype
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    if family in MOE_DEFAULTS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    param.normal_(0.0, ROUTER_INIT_STD)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}, f)
    return out_dir
