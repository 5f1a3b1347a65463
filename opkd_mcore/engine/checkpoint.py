"""Save / restore a `MegatronEngine`: model + optimizer + LR scheduler, one dist checkpoint.

The format is the one `opkd convert` writes (`opkd_mcore.models.convert`), with the optimizer and
scheduler state added, so a training checkpoint converts to HF with `opkd convert mcore-to-hf` and a
converted checkpoint starts a training run (`load_checkpoint` then restores the model only).
"""
from __future__ import annotations

import logging

import torch

from opkd_mcore.models.convert import (
    load_mcore_model,
    model_sharded_state_dict,
    read_checkpoint_meta,
    save_mcore_checkpoint,
)

logger = logging.getLogger(__name__)

OPTIMIZER_KEY = "optimizer"
SCHEDULER_KEY = "opt_param_scheduler"
STEPS_KEY = "num_steps"
DISTRIBUTED_OPTIMIZER_SHARDING = "dp_reshardable"


def _optimizer_state(engine, model_state: dict, is_loading: bool) -> dict:
    # the optimizer state is sharded like the parameters it belongs to; Megatron maps it from the
    # model's sharded state dict (nested per chunk: the chunks' local keys repeat under VPP)
    # distributed optimizer: Megatron's default layout ("fully_sharded_model_space") cannot be saved by
    # this dist_checkpointing version; "dp_reshardable" saves each rank's buffers as they are (fast,
    # reloadable with another DP size but the same TP/PP)
    metadata = {"distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_SHARDING}
    return engine.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)


def save_engine_checkpoint(engine, ckpt_dir: str) -> None:
    """Collective over all ranks. Forward-only engines save the model only."""
    extra, contents = {}, ("model",)
    if engine.optimizer is not None:
        model_state = model_sharded_state_dict(engine.model)
        extra = {OPTIMIZER_KEY: _optimizer_state(engine, model_state, is_loading=False),
                 SCHEDULER_KEY: engine.scheduler.state_dict(), STEPS_KEY: engine.num_steps}
        contents = ("model", "optimizer", "scheduler")
    save_mcore_checkpoint(engine.model, ckpt_dir, extra_state=extra, contents=contents,
                          num_steps=engine.num_steps)
    logger.info("saved %s at step %d to %s", "+".join(contents), engine.num_steps, ckpt_dir)


def load_engine_checkpoint(engine, ckpt_dir: str) -> None:
    """Collective. Restores the optimizer/scheduler too when both engine and checkpoint have them."""
    meta = read_checkpoint_meta(ckpt_dir)
    with_optimizer = engine.optimizer is not None and "optimizer" in meta["contents"]
    extra = {}
    if with_optimizer:
        model_state = model_sharded_state_dict(engine.model)
        extra = {OPTIMIZER_KEY: _optimizer_state(engine, model_state, is_loading=True),
                 SCHEDULER_KEY: None, STEPS_KEY: None}
    loaded = load_mcore_model(engine.model, ckpt_dir, extra)
    if with_optimizer:
        with torch.no_grad():  # fp32 main params of the distributed optimizer are views of leaf params
            engine.optimizer.load_state_dict(loaded[OPTIMIZER_KEY])
        _restore_adam_steps(engine.optimizer, loaded[OPTIMIZER_KEY])
        engine.scheduler.load_state_dict(loaded[SCHEDULER_KEY])
        engine.num_steps = int(loaded[STEPS_KEY])
    elif engine.optimizer is not None:
        # a converted (model-only) checkpoint: fp32 main params must follow the freshly loaded weights
        engine.optimizer.reload_model_params()
    logger.info("loaded %s from %s (step %d)", "model+optimizer" if with_optimizer else "model",
                ckpt_dir, engine.num_steps)


def _restore_adam_steps(optimizer, loaded_state) -> None:
    """Set torch Adam's per-parameter step counters from the checkpoint (distributed optimizer).

    Without Apex/TE the distributed optimizer keeps the step in its param groups, and its
    `load_state_dict` either leaves the live counters untouched or installs ONE tensor shared by
    all parameters (which torch then increments once per parameter). Either way the bias
    correction of every later update would be wrong; give each parameter its own counter.
    """
    leaves = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if isinstance(loaded_state, dict) and loaded_state and all(isinstance(k, int) for k in loaded_state):
        # several chained optimizers (an MoE model: dense and expert parameters) save {index: state}
        states = [loaded_state[k] for k in sorted(loaded_state)]
    else:
        states = loaded_state if isinstance(loaded_state, list) else [loaded_state]
    for leaf, state in zip(leaves, states):
        groups = (state.get("optimizer") or {}).get("param_groups", []) if isinstance(state, dict) else []
        steps = {g["step"] for g in groups if g.get("step") is not None}
        inner = getattr(leaf, "optimizer", None)
        if len(steps) != 1 or inner is None:
            continue
        step = float(steps.pop())
        for param_state in inner.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step, dtype=torch.float32)
