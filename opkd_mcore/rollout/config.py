"""Typed configs of the rollout engine: how to sample, and how to build the vLLM engine."""
from __future__ import annotations

from dataclasses import dataclass, field

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass(kw_only=True)
class SamplingConfig:
    """Sampling parameters of one rollout batch (mapped onto `vllm.SamplingParams`)."""

    n: int = 1  # samples per prompt (a GRPO-style group shares one group_id)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    top_k: int = -1  # tokens kept; -1 (or 0) = off
    max_new_tokens: int = 64  # response length cap; finish_reason "length" when hit
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides EOS
    seed: int | None = None  # per-request seed; None = engine's random stream
    # each response comes with the sampler's logprob of every token; False: vLLM takes no log-softmax
    # over the vocabulary per decode step, builds no per-token lists, `Sample.response_logprobs` is None
    logprobs: bool = True

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling.n: expected >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature: expected >= 0, got {self.temperature}")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"sampling.n: greedy sampling (temperature 0) gives one response per "
                             f"prompt, expected n=1, got {self.n}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"sampling.top_k: expected -1 (off) or >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens: expected >= 1, got {self.max_new_tokens}")


@dataclass(kw_only=True)
class RolloutConfig:
    """How the vLLM rollout engine is built (one engine per process / Ray actor)."""

    tensor_parallel_size: int = 1  # vLLM TP inside one engine
    dtype: str = "auto"  # weights/activations dtype of the engine ("auto" = checkpoint's)
    max_model_len: int | None = None  # prompt + response cap; None = checkpoint's
    gpu_memory_utilization: float = 0.5  # accelerator share for weights + KV cache (ignored on CPU)
    enforce_eager: bool = True  # no graph capture: fast start, weights can be swapped safely
    enable_sleep_mode: bool = False  # colocated mode: free KV cache / weights between rollouts
    # "processed_logprobs": logprobs of the distribution actually sampled (after temperature,
    # top-k/top-p) -- the behaviour policy; "raw_logprobs": the model's plain log-softmax.
    logprobs_mode: str = "processed_logprobs"
    seed: int = 0  # engine seed
    max_logprobs: int = 20  # largest prompt/sample logprobs k this engine will return (-1 = all)
    use_tqdm: bool = False  # vLLM's own progress bar per generate call
    # vLLM decodes each response to text token by token; nothing downstream reads it (a `Sample`
    # holds token ids; rewards and logs decode the ids themselves), so it is off
    detokenize: bool = False
    # True: every sample is a request of its own seeded from its prompt's seed (reproducible whatever
    # the batching), at the price of one RNG kernel per request per decode step in vLLM's V1 model
    # runner sampler; False: the n samples of a prompt are one request drawn from the engine's stream
    # (seeded by `seed`: reproducible for the same batch on the same engine only), as TRL samples
    per_sample_seeds: bool = True
    # True: vLLM's engine core (scheduler, output processing) and, at TP=1, its model worker run in
    # this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocated mode): no message between
    # processes per decode step, but output processing no longer overlaps the next step, and the
    # worker joins this process's torch.distributed world, so a process that has one cannot hold it
    engine_in_process: bool = False
    extra_engine_kwargs: dict = field(default_factory=dict)  # passed to vllm.LLM as is

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"rollout.tensor_parallel_size: expected >= 1, got {self.tensor_parallel_size}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"rollout.logprobs_mode: expected one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"rollout.max_logprobs: expected -1 or >= 0, got {self.max_logprobs}")
