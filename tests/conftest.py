import os

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# vLLM engines in tests take a small share of a GPU, so several (and the trainer) fit at once; on
# CPU the share is ignored (VLLM_CPU_KVCACHE_SPACE sizes the cache)
ENGINE_MEMORY = 0.12


def engine_kwargs(**extra) -> dict:
    """Keyword arguments for a `vllm.LLM` (or RolloutConfig / VllmTeacherConfig) built by a test."""
    return {"gpu_memory_utilization": ENGINE_MEMORY, **extra}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
