"""A `transformers` teacher: plain HF forward on this process, dense or top-k.

For small teachers, offline checks, and as the reference the other backends are tested against.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, TopKTeacher
from opkd_mcore.teacher.base import Teacher, TeacherOutput, check_outputs, check_sequences


class TransformersTeacher(Teacher):
    """`AutoModelForCausalLM` forward; `k=None` gives full-vocabulary `DenseTeacher` logits / T."""

    def __init__(self, model_dir: str, *, k: int | None = 20, temperature: float = 1.0,
                 dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        if k is not None and k < 1:
            raise ValueError(f"k: expected >= 1 or None (dense), got {k}")
        if temperature <= 0:
            raise ValueError(f"temperature: expected > 0, got {temperature}")
        self.model_dir, self.k, self.temperature = model_dir, k, temperature
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.calls = 0

    @property
    def address(self) -> str:
        return self.model_dir

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> list[TeacherOutput]:
        self.calls += 1
        out = []
        seqs = check_sequences(sequences)
        for seq in seqs:
            logits = self.model(torch.tensor([seq])).logits[0, :-1].float() / self.temperature
            if self.k is None:
                out.append(DenseTeacher(logits=logits))
                continue
            values, ids = torch.log_softmax(logits.double(), dim=-1).topk(min(self.k, logits.shape[-1]))
            pad = self.k - ids.shape[-1]  # vocabulary smaller than k: pad with id -1 / -inf
            ids = torch.nn.functional.pad(ids, (0, pad), value=PAD_ID)
            values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
            out.append(TopKTeacher(ids=ids, logprobs=values.float()))
        check_outputs(seqs, out, self.address)  # NaN from the model is an error naming it
        return out
