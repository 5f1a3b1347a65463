import os

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# vLLM engines in tests take a small share of a GPU, so several (and the trainer) fit at once; on
# CPU the share is ignored (VLLM_CPU_KVCACHE_SPACE sizes the cache)
ENGINE_MEMORY = 0.12

# A float32 vLLM engine's logprobs vs a float64 `transformers` forward. On CPU: float32 rounding of
# logits of size ~5 over a 256-entry softmax, well inside 2e-3. On a GPU, vLLM's Triton attention
# multiplies float32 inputs in TF32 (10-bit mantissa, unit roundoff 2^-11 ~ 4.9e-4, relative), which
# moves logprobs of this size by a few 1e-3 (2.6e-3 seen on an H200 for rollout logprobs, 2.4e-3 for
# a served teacher's prompt logprobs): the bound follows the arithmetic of the device.
VLLM_FP32_LOGPROB_ATOL = 6e-3 if torch.cuda.is_available() else 2e-3


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
