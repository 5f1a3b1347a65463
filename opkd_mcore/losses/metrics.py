"""Per-batch distillation metrics, as 0-d tensors (no host sync; the logger reads them once per step).

Names follow `group/name`:
- `kd/loss_mean`, `kd/loss_max`: per-token loss over the counted tokens.
- `kd/teacher_mass_on_support`: mean of Σ_S p — how much teacher probability the support keeps.
- `kd/student_mass_on_support`: mean of Σ_S q — where the student puts its mass (TCAD's coverage).
- `kd/topk_overlap`: mean fraction of the teacher's top-k ids that are in the student's top-k.
"""
from __future__ import annotations

import torch

from opkd_mcore.losses.kd_loss import KDStats


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over `mask`; 0 for an empty mask."""
    weights = mask.to(x.dtype)
    return (torch.where(mask.bool(), x, torch.zeros_like(x)) * weights).sum() / weights.sum().clamp(min=1)


def kd_metrics(per_token_loss: torch.Tensor, loss_mask: torch.Tensor | None = None,
               stats: KDStats | None = None, group: str = "kd") -> dict[str, torch.Tensor]:
    """Metrics of one batch; `loss_mask [N]` selects counted tokens (default all)."""
    loss = per_token_loss.detach()
    if loss_mask is None:
        loss_mask = torch.ones_like(loss, dtype=torch.bool)
    if loss_mask.shape != loss.shape:
        raise ValueError(f"loss_mask: expected shape {tuple(loss.shape)} (that of per_token_loss), "
                         f"got {tuple(loss_mask.shape)}")
    counted = loss_mask.bool()
    loss_max = loss.new_zeros(())
    if loss.numel():
        loss_max = torch.where(counted, loss, torch.full_like(loss, float("-inf"))).amax()
        loss_max = torch.where(counted.any(), loss_max, torch.zeros_like(loss_max))
    out = {f"{group}/loss_mean": masked_mean(loss, counted), f"{group}/loss_max": loss_max}
    if stats is not None:
        out[f"{group}/teacher_mass_on_support"] = masked_mean(stats.teacher_mass.to(loss.dtype), counted)
        out[f"{group}/student_mass_on_support"] = masked_mean(stats.student_mass.to(loss.dtype), counted)
        if stats.topk_overlap is not None:
            out[f"{group}/topk_overlap"] = masked_mean(stats.topk_overlap.to(loss.dtype), counted)
    return out
