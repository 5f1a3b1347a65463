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

import torch

from opkd_mcore.config.schema import OptimSection

logger = logging.getLogger(__name__)

def megatron_optimizer_config(cfg: OptimSection, params_dtype: torch.dtype):
    """Megatron's `OptimizerConfig` for `cfg`. Clipping is off there: `clip_and_step` does it."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=0.0, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        params_dtype=params_dtype, use_distributed_optimizer=cfg.use_distributed_optimizer,
        # Megatron-LM sets both configs alike; the optimizer reads it only for MXFP8 param buffers
        overlap_param_gather=cfg.overlap_param_gather,
    )


def ddp_config(cfg: OptimSection):
    """Megatron's DDP config for `cfg`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32, overlap_grad_reduce=cfg.overlap_grad_reduce,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        # the all-gather after optimizer.step() is left to the next forward's pre-hooks: the model's
        # params are stale until then (`MegatronEngine.fresh_params`)
        overlap_param_gather=cfg.overlap_param_gather,
        # the loss is already normalised by the global token count: gradients are summed over DP
        average_in_collective=False,
    )


def build_optimizer(model_chunks: list, cfg: OptimSection, params_dtype: torch.dtype):
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
