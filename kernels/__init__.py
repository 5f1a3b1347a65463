"""Fused distillation kernels (Triton on CUDA, C++ on CPU). Pure functions on tensors.

    fused_kd_loss(student_logits, teacher_logits=None, topk_ids=None, topk_logprobs=None, *,
                  spec=KdSpec(...), tp_group=None, backend="auto", inplace_grad=None) -> loss [N]

    fused_linear_kd_loss(hidden, weight, teacher_hidden=None, teacher_weight=None, topk_ids=None,
                         topk_logprobs=None, *, spec=KdSpec(...), tp_group=None, backend="auto") -> loss [N]

Files: one Triton kernel per `kd_*.py`; `triton_backend.py` / `cpu_backend.py` (shim over the
optional C++ twin `opkd_kernels._cpu`, built from csrc/) / `torch_backend.py` expose the same four
primitives; `fused_kd.py` holds the autograd Function and the TP collectives; `sparse_objective.py`
the objective on a sparse support. The fused LM head (output layer + loss, no logits):
`fused_linear_kd.py` (autograd Function, reusing fused_kd's math and collectives), its Triton tile
kernels `linear_kd_*.py` (engine: `linear_kd_triton.py`; their shared logit tile: `_logit_tile.py`)
and the chunked torch twin `linear_kd_chunked.py`. Triton is imported only when a Triton kernel
runs.
"""
from .fused_kd import KdSpec, fused_kd_loss, select_backend
from .fused_linear_kd import fused_linear_kd_loss

__all__ = ["KdSpec", "fused_kd_loss", "fused_linear_kd_loss", "select_backend"]
