"""Fused distillation kernels (Triton on CUDA, C++ on CPU). Pure functions on tensors.

    fused_kd_loss(student_logits, teacher_logits=None, topk_ids=None, topk_logprobs=None, *,
                  spec=KdSpec(...), tp_group=None, backend="auto", inplace_grad=None) -> loss [N]

Files: one Triton kernel per `kd_*.py`; `triton_backend.py` / `cpu_backend.py` (shim over the
optional C++ twin `opkd_kernels._cpu`, built from csrc/) expose the same four primitives;
`fused_kd.py` holds the autograd Function and the TP collectives; `sparse_objective.py` the
objective on a sparse support. Triton is imported only when a Triton kernel runs.
"""
from .fused_kd import KdSpec, fused_kd_loss, select_backend

__all__ = ["KdSpec", "fused_kd_loss", "select_backend"]
