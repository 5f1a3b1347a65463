"""The fused LM head in a Megatron step: final hidden states instead of logits on the last stage.

When the run's loss plan turns the fused LM head on (`losses/plan.py`, passed to the engine as
`train_step(..., fused_lm_head=True)`), the engine runs each GPTModel chunk with its output layer
bypassed (`hidden_output`: Megatron's `GPTModel` returns the decoder's final-norm hidden states when
`post_process` is off, on every release we support) and hands the loss an `LmHeadInput`: the hidden
states of this rank `[T, H]` and the output-weight shard `[V_local, H]` the output layer would have
used (the embedding when input and output weights are tied). The loss (`objective.make_loss_fn`)
then calls `linear_kd_loss`; the weight gets its gradient from the fused backward, through the same
parameter object, so Megatron DDP reduces it as usual (tied weights: both uses add up).

The hidden states enter the TP region exactly as `ColumnParallelLinear`'s input does: gathered along
the sequence with sequence parallelism (backward: reduce-scatter), else copied (backward: all-reduce
of this rank's partial gradient over its vocabulary shard).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LmHeadInput:
    """What `loss_fn` receives on the last pipeline stage when the fused LM head is on."""

    hidden: torch.Tensor                  # [T, H] student final-norm hidden states (all of this rank's rows)
    weight: torch.Tensor                  # [V_local, H] this TP rank's output-weight shard
    vocab_size: int | None = None         # the student's real vocabulary; columns past it are padding


def gpt_model(module):
    """The Megatron GPTModel inside DDP / Float16Module / PairedChunk wrappers."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def output_weight(gpt) -> torch.Tensor:
    """The `[V_local, H]` weight the output layer multiplies by (tied: the embedding's shard)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


@contextlib.contextmanager
def hidden_output(*gpts):
    """GPTModels return final-norm hidden states `[S, B, H]` (not logits) inside this block."""
    saved = [g.post_process for g in gpts]
    try:
        for g in gpts:
            g.post_process = False   # GPTModel._postprocess returns the decoder output as is
        yield
    finally:
        for g, mode in zip(gpts, saved):
            g.post_process = mode


def hidden_rows(hidden_SBH: torch.Tensor, num_tokens: int, gpt, tp_group, *,
                trainable: bool = True) -> torch.Tensor:
    """`[S(/TP), 1, H]` decoder output -> `[T, H]` rows in the TP region the output layer would use."""
    from megatron.core import tensor_parallel

    sequence_parallel = bool(getattr(gpt.config, "sequence_parallel", False))
    if sequence_parallel:
        hidden_SBH = tensor_parallel.gather_from_sequence_parallel_region(hidden_SBH, group=tp_group)
    elif trainable:
        hidden_SBH = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_SBH, group=tp_group)
    rows = hidden_SBH[:, 0]
    return rows if rows.shape[0] == num_tokens else rows[:num_tokens]
