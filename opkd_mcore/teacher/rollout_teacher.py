"""The student's rollout engine as its own top-k teacher (`backend: self`, `output: topk`).

The rollout engine holds the student's current weights (synced after every step); scoring the
teacher's sequences (its own prompt + the sampled response) with `prompt_logprobs` there gives the
student's top-k distribution under the privileged context without a forward inside the training
step and without another engine. It is `VllmTeacher` on the rollout's `vllm.LLM`: the engine is
built with raw logprobs and `max_logprobs >= top_k` for it (`train/components.build_rollout`), and
vLLM reads no prefix-cache blocks for a request with prompt logprobs, so every position is scored.
"""
from __future__ import annotations

from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig


class RolloutEngineTeacher(VllmTeacher):
    """Top-k rows from the rollout engine `rollout` (a `VllmRollout`); the engine stays the rollout's."""

    def __init__(self, rollout, *, k: int, name: str = "self"):
        super().__init__(rollout.llm, VllmTeacherConfig(k=k))
        self._address = f"{name} (the student's rollout engine, {rollout.model_dir})"
