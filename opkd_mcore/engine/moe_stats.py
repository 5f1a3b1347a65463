"""Router bookkeeping of an MoE student: the load-balancing loss's scale and the step's metrics.

The load-balancing (auxiliary) loss is Megatron's own: each `TopKRouter` attaches it to its routing
probabilities (`MoEAuxLossAutoScaler`) when `moe_router_load_balancing_type="aux_loss"` and
`moe_aux_loss_coeff > 0`, so its gradient reaches the router with no term in our objective. Megatron
expects it averaged over micro-batches and data-parallel replicas; the engine instead *sums*
gradients over both (the KD loss is normalised by the global token count already), so each step the
coefficient the routers read is set to `coef / (micro-batches * dp)`: the step's loss is then
`kd + coef * sum over MoE layers of the mean per-micro-batch load-balancing loss`, as in Megatron.

Metrics of a training step (every rank gets the same values):

* `moe/aux_loss`: the load-balancing loss (without the coefficient) averaged over MoE layers and
  micro-batches: `E * sum_e f_e * P_e`, 1.0 when routing is uniform. Only when the loss is on
  (Megatron computes it only then).
* `moe/expert_load_max`, `moe/expert_load_min`: over all MoE layers and experts, the tokens routed
  to an expert divided by the mean per expert of its layer (1.0 = perfectly balanced), counted by a
  forward hook on every router while training, over all micro-batches and DP replicas.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from opkd_mcore.platform.device import current_device

AUX_LOSS_NAME = "load_balancing_loss"  # Megatron's tracker key for the "aux_loss" type


def _routers(model_chunks) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


class MoeStepStats:
    """Attach to the student's chunks once (`attach`); `begin_step` / `end_step` around each step."""

    def __init__(self, model_chunks, config):
        self.config = config
        self.aux_loss_coef = float(config.moe_aux_loss_coeff or 0.0)
        self.num_layers = config.num_layers
        self.num_experts = config.num_moe_experts
        self.routers = _routers(model_chunks)
        # on the compute device: accelerator collective backends reduce no host tensors, and the
        # per-layer hook must not copy to the host (a sync per layer and micro-batch)
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64,
                                  device=current_device())
        self._handles = []
        for router in self.routers:
            # per-token scaling of the aux loss assumes Megatron's division by the token count at
            # finalize, which the engine leaves out; the coefficient is scaled per step instead
            router.calculate_per_token_loss = False
            self._handles.append(router.register_forward_hook(self._count))

    @classmethod
    def attach(cls, model_chunks, config) -> MoeStepStats | None:
        return cls(model_chunks, config) if getattr(config, "num_moe_experts", None) else None

    def _count(self, router, inputs, outputs) -> None:
        if not router.training or router.layer_number is None:
            return
        routing_map = outputs[1]
        self.counts[router.layer_number - 1] += routing_map.sum(dim=0)

    def begin_step(self, num_micro_batches: int) -> None:
        """Zero the counters and scale the aux-loss coefficient for this step's micro-batches."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()
        self.num_micro_batches = num_micro_batches
        if self.aux_loss_coef > 0:
            dp = ps.get_data_parallel_world_size(with_context_parallel=True)
            self.config.moe_aux_loss_coeff = self.aux_loss_coef / (num_micro_batches * dp)

    def end_step(self) -> dict[str, float]:
        """Collective over every rank: the step's MoE metrics."""
        from megatron.core import parallel_state as ps

        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        pp_group = ps.get_pipeline_model_parallel_group()
        counts = self.counts   # reduced in place: begin_step zeroes it before it counts again
        # stages hold distinct layers (sum over PP); replicas see distinct tokens (sum over DP);
        # TP ranks see the same tokens unless sequence parallelism splits them
        groups = [pp_group, dp_group]
        if self.config.sequence_parallel:
            groups.append(ps.get_tensor_model_parallel_group())
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
        counts = counts.cpu()
        per_layer = counts.sum(dim=1, keepdim=True)
        routed = per_layer.squeeze(1) > 0
        metrics = {}
        if routed.any():
            load = counts[routed] / (per_layer[routed] / self.num_experts)
            metrics.update({"moe/expert_load_max": float(load.max()),
                            "moe/expert_load_min": float(load.min())})
        if self.aux_loss_coef > 0:
            metrics["moe/aux_loss"] = self._aux_loss(pp_group, dp_group)
        return metrics

    def _aux_loss(self, pp_group, dp_group) -> float:
        """Megatron's tracked per-layer losses, reduced like its `track_moe_metrics` (by hand: gloo
        has no AVG reduction)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entry = get_moe_layer_wise_logging_tracker().get(AUX_LOSS_NAME)
        values = torch.zeros(self.num_layers, dtype=torch.float64, device=self.counts.device)
        if entry is not None:
            values = entry["values"].detach().to(self.counts.device, torch.float64)
        if dist.get_world_size(pp_group) > 1:
            dist.all_reduce(values, group=pp_group)
        reduce_group = entry.get("reduce_group") if entry is not None else None
        if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
            dist.all_reduce(values, group=reduce_group)
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(values, group=dp_group)
            values /= dist.get_world_size(dp_group)
        return float(values.sum() / (self.num_layers * self.num_micro_batches))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
