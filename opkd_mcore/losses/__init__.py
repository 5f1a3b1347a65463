"""Distillation objectives over a vocabulary sharded across a tensor-parallel group.

Token level: `kd_loss` (and `kd_loss_with_stats` for logging); `linear_kd_loss` fuses the output
layer into it (hidden states + weight shard in, no logits; `linear_kd_loss_weighted` takes the
scalar's per-token weights and computes the gradients in the forward). Sequence level: TCAD's
`teacher_confidence_scores` / `teacher_confidence_weights`, `sampled_token_kl` and
`policy_gradient_kd_loss`. Reduction to a scalar: `aggregate` (its per-token weights:
`aggregate_row_weights`). Logging: `kd_metrics`. Across tokenizers: `cross_tokenizer_loss` on a
`CrossTokenizerTeacher` (the teacher's rows on its own tokens, paired with the student's by span).
Formulas and which objective reproduces which recipe: docs/losses.md.
"""
from opkd_mcore.losses.aggregation import AGG_MODES, aggregate, aggregate_row_weights, seq_ids_from_cu_seqlens
from opkd_mcore.losses.cross_tokenizer import CrossTokenizerStats, cross_tokenizer_loss
from opkd_mcore.losses.fused_linear import linear_kd_loss, linear_kd_loss_weighted, linear_kd_loss_with_stats
from opkd_mcore.losses.kd_loss import KDStats, kd_loss, kd_loss_with_stats, topk_overlap
from opkd_mcore.losses.metrics import kd_metrics
from opkd_mcore.losses.sequence_level import (
    PolicyGradientKDOutput,
    policy_gradient_kd_loss,
    sampled_token_kl,
    teacher_confidence_scores,
    teacher_confidence_weights,
)
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher, SpanIndex
from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, HiddenTeacher, TopKTeacher

__all__ = [
    "AGG_MODES",
    "PAD_ID",
    "CrossTokenizerStats",
    "CrossTokenizerTeacher",
    "DenseTeacher",
    "HiddenTeacher",
    "KDStats",
    "PolicyGradientKDOutput",
    "SpanIndex",
    "TopKTeacher",
    "aggregate",
    "aggregate_row_weights",
    "cross_tokenizer_loss",
    "kd_loss",
    "kd_loss_with_stats",
    "kd_metrics",
    "linear_kd_loss",
    "linear_kd_loss_weighted",
    "linear_kd_loss_with_stats",
    "policy_gradient_kd_loss",
    "sampled_token_kl",
    "seq_ids_from_cu_seqlens",
    "teacher_confidence_scores",
    "teacher_confidence_weights",
    "topk_overlap",
]
