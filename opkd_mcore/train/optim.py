"""Optimizer, learning-rate schedule and gradient clipping for the Megatron student.

The optimizer is Megatron's (`get_megatron_optimizer`: Adam with fp32 main params when the model
is bf16, optionally sharded over DP as the distributed optimizer); the schedule is Megatron's
`OptimizerParamScheduler`. Clipping is done here rather than inside Megatron's `step()`, because
Megatron's clip asserts accelerator tensors: on CPU the norm is computed by Megatron (it only needs
collectives) and the scaling by `_scale_grads_`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields

import torch

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimConfig:
    """Optimizer + LR schedule of the student. Defaults work for the CPU demo."""

    lr: float = 1e-5  # peak learning rate (reached after warmup)
    min_lr: float = 0.0  # floor of the decay schedule
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.999  # Adam second-moment decay
    adam_eps: float = 1e-8  # Adam denominator epsilon
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    warmup_steps: int = 0  # linear warmup from 0 to `lr` over this many optimizer steps
    lr_decay_steps: int | None = None  # steps until `min_lr`; None = no decay (constant after warmup)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    use_distributed_optimizer: bool = False  # shard optimizer state over the data-parallel group
    overlap_grad_reduce: bool = False  # overlap DP gradient reduction with backward (GPU only)
    grad_reduce_in_fp32: bool = True  # reduce bf16 gradients in fp32 across DP

    def validate(self) -> None:
        # NaN passes every `<` check below and inf makes Adam's update NaN: reject both first
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"OptimConfig.{f.name}: expected a finite number, got {value}")
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr: expected > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"OptimConfig.min_lr: expected 0 <= min_lr <= lr={self.lr}, got {self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay: expected >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimConfig.{name}: expected in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"OptimConfig.adam_eps: expected > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"OptimConfig.clip_grad: expected >= 0 (0 = off), got {self.clip_grad}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps: expected >= 0, got {self.warmup_steps}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"OptimConfig.lr_decay_style: expected one of {LR_DECAY_STYLES}, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= 0:
            raise ValueError(f"OptimConfig.lr_decay_steps: expected > 0 or None (no decay), "
                             f"got {self.lr_decay_steps}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None or self.lr_decay_steps <= self.warmup_steps:
                raise ValueError(f"OptimConfig.lr_decay_steps: a {self.lr_decay_style!r} decay needs "
                                 f"lr_decay_steps > warmup_steps={self.warmup_steps}, "
                                 f"got {self.lr_decay_steps}")


def megatron_optimizer_config(cfg: OptimConfig, params_dtype: torch.dtype):
    """Megatron's `OptimizerConfig` for `cfg`. Clipping is off there: `clip_and_step` does it."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=0.0, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        params_dtype=params_dtype, use_distributed_optimizer=cfg.use_distributed_optimizer,
    )


def ddp_config(cfg: OptimConfig):
    """Megatron's DDP config for `cfg`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32, overlap_grad_reduce=cfg.overlap_grad_reduce,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        # the loss is already normalised by the global token count: gradients are summed over DP
        average_in_collective=False,
    )


def build_optimizer(model_chunks: list, cfg: OptimConfig, params_dtype: torch.dtype):
    """Megatron optimizer + LR scheduler for DDP-wrapped `model_chunks`."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(megatron_optimizer_config(cfg, params_dtype), model_chunks)
    constant = cfg.lr_decay_style == "constant"
    # Megatron's scheduler needs decay_steps > warmup_steps even for a constant schedule
    decay_steps = cfg.warmup_steps + 1 if constant else cfg.lr_decay_steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.warmup_steps else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant",
    )
    return optimizer, scheduler


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _scale_grads_(optimizer, coeff: float) -> None:
    """Multiply the main gradients that the optimizer steps on by `coeff` (device-agnostic)."""
    for leaf in _leaf_optimizers(optimizer):
        if getattr(leaf, "is_stub_optimizer", False):
            continue
        for param in leaf.get_parameters():
            grad = getattr(param, "decoupled_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grad.mul_(coeff)


def clip_and_step(optimizer, clip_grad: float, on_cpu: bool, skip: bool = False) -> tuple[bool, float]:
    """Unscale/copy gradients, clip to `clip_grad` (global norm over all shards), step.

    Returns (update applied, grad norm before clipping). An update is skipped when the fp16 loss
    scaler found inf/nan, when the gradient norm is not finite (any dtype), or when the caller
    says so (`skip`, e.g. a non-finite loss): a non-finite step is never applied. Same result as
    Megatron's `step()`, but the scaling is our own on CPU where Megatron's clip asserts
    accelerator tensors.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    if found_inf:
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())  # collective: every rank computes it
    if skip or not math.isfinite(grad_norm):
        return False, grad_norm
    if clip_grad > 0 and grad_norm > clip_grad:
        if on_cpu:
            _scale_grads_(optimizer, clip_grad / (grad_norm + 1.0e-6))
        else:
            for leaf in _leaf_optimizers(optimizer):
                params = leaf.get_parameters()
                if params and not getattr(leaf, "is_stub_optimizer", False):
                    clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=grad_norm)
    applied = optimizer.step_with_ready_grads()
    return bool(applied), grad_norm
