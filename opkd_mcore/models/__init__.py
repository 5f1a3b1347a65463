"""HF checkpoints <-> Megatron-core GPTModel: build, load (sliced), export (stream), save."""
from opkd_mcore.models.bridge import BRIDGES, ModelBridge, get_bridge
from opkd_mcore.models.builder import (
    TORCH_DTYPES,
    ModelLayout,
    build_model,
    layout_of,
    load_hf_config,
    padded_vocab_size,
)
from opkd_mcore.models.weights import (
    WeightMeta,
    hf_weight_metadata,
    iter_hf_weights,
    load_hf_weights,
    save_hf_checkpoint,
    shard_writes,
)

__all__ = [
    "BRIDGES",
    "ModelBridge",
    "ModelLayout",
    "TORCH_DTYPES",
    "WeightMeta",
    "build_model",
    "get_bridge",
    "hf_weight_metadata",
    "iter_hf_weights",
    "layout_of",
    "load_hf_config",
    "load_hf_weights",
    "padded_vocab_size",
    "save_hf_checkpoint",
    "shard_writes",
]
