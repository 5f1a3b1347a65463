"""Rollout: the vLLM engine that generates the student's responses (see DESIGN.md)."""
from opkd_mcore.rollout.config import RolloutConfig, SamplingConfig
from opkd_mcore.rollout.sample import Sample
from opkd_mcore.rollout.vllm_rollout import VllmRollout

__all__ = ["RolloutConfig", "SamplingConfig", "Sample", "VllmRollout"]


def __getattr__(name):  # vLLM is imported only when the engine is used
    if name == "VllmRollout":
        return VllmRollout
    raise AttributeError(name)
