"""vLLM rollout engine: n samples per prompt with sampler logprobs, stamped with a weight version.

One `VllmRollout` owns one in-process `vllm.LLM` (which may itself span a TP group of workers).
Data-parallel rollout runs one of these per Ray actor. Weight updates are bracketed by
`pause()` / `resume()`: `pause()` waits for the generate call in flight and holds new ones back,
so every sample of a call is generated with one version of the weights, the one it records.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Sequence

import torch.distributed as dist

from opkd_mcore.data.build import encode_chat
from opkd_mcore.platform import is_cpu
from opkd_mcore.rollout.config import RolloutConfig, SamplingConfig
from opkd_mcore.rollout.engine_env import child_pids, engine_environment, yield_cpu_to_trainer
from opkd_mcore.rollout.sample import Sample

logger = logging.getLogger(__name__)

# whether an engine core was built in this process (rollout.engine_in_process): vLLM caches its
# environment then
_engine_core_built_here = False


def sleep_mode_available() -> bool:
    """Whether the vLLM platform of this process can free weights / KV cache on `sleep()`."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def sample_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (stable across processes and Python versions)."""
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def to_sampling_params(sampling: SamplingConfig, *, logprobs: int | None = 0, detokenize: bool = False):
    """`SamplingConfig` -> `vllm.SamplingParams` asking for the sampled token's logprob (`logprobs`
    None: none); `detokenize`: vLLM also decodes the response to text (`RolloutConfig.detokenize`)."""
    from vllm import SamplingParams

    sampling.validate()
    return SamplingParams(
        n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=logprobs,
        flat_logprobs=True,  # flat lists per completion, not a dict of objects per token
        detokenize=detokenize,
    )


def check_in_process_engine(cfg: RolloutConfig) -> None:
    """An engine core in this process cannot be built where it would break the process: its TP=1
    model worker joins the torch.distributed world already there (the torchrun trainer's: every
    rank would have to join, and a weight sync by device IPC cannot open its own process's
    handles), and vLLM fixes the engine mode of a process with the first engine core built in it."""
    if not cfg.engine_in_process:
        return
    if cfg.tensor_parallel_size == 1 and dist.is_available() and dist.is_initialized():
        raise ValueError("rollout.engine_in_process: this process already has a torch.distributed world "
                         f"(rank {dist.get_rank()} of {dist.get_world_size()}), which vLLM's TP=1 worker "
                         "would join; expected a process without one (the Ray controller's rollout actor)")
    if _engine_core_built_here:
        raise ValueError("rollout.engine_in_process: a rollout engine core was built in this process "
                         "before, and vLLM keeps the engine settings it read then; expected one per process")


class VllmRollout:
    """In-process vLLM generator for the student.

    Args:
        model_dir: Hugging Face checkpoint directory (weights + tokenizer).
        cfg: engine settings (`RolloutConfig()` works on CPU).
        worker_extension_cls: dotted path of a class mixed into vLLM's workers (weight receive).
    """

    def __init__(self, model_dir: str, cfg: RolloutConfig | None = None,
                 worker_extension_cls: str | None = None):
        self.cfg = cfg or RolloutConfig()
        self.cfg.validate()
        self.model_dir = model_dir
        check_in_process_engine(self.cfg)
        self._sleep_supported = sleep_mode_available()
        self.llm = self._build_engine(worker_extension_cls)
        self._version = 0
        self._asleep = False
        self._paused = False
        self._in_flight = 0
        self._cond = threading.Condition()

    def _build_engine(self, worker_extension_cls: str | None):
        global _engine_core_built_here
        from vllm import LLM

        cfg = self.cfg
        if cfg.enable_sleep_mode and not self._sleep_supported:
            logger.warning("rollout.enable_sleep_mode: the vLLM platform of this process has no sleep "
                           "mode; the engine keeps its weights and KV cache resident.")
        kwargs = dict(
            model=self.model_dir, tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.dtype,
            max_model_len=cfg.max_model_len, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, logprobs_mode=cfg.logprobs_mode, seed=cfg.seed,
            max_logprobs=cfg.max_logprobs,
            enable_sleep_mode=cfg.enable_sleep_mode and self._sleep_supported,
        )
        if worker_extension_cls:
            kwargs["worker_extension_cls"] = worker_extension_cls
        kwargs.update(cfg.extra_engine_kwargs)

        if not cfg.per_sample_seeds:
            logger.info("rollout: the n samples of a prompt are one request drawn from the engine's random "
                        "stream (seed %d); per-prompt seeds are not used", cfg.seed)
        before = child_pids()
        with engine_environment(in_process=cfg.engine_in_process):
            llm = LLM(**kwargs)
        if cfg.engine_in_process:
            _engine_core_built_here = True
        if is_cpu():
            yield_cpu_to_trainer(before)
        return llm

    # ---- weight versions and pausing -------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine holds now (0 = the checkpoint it was built from)."""
        return self._version

    def set_weight_version(self, version: int, engine_stamped: bool = False) -> None:
        """Record that new weights (of `version`) are loaded; call between pause() and resume().
        `engine_stamped`: the weight sync has given vLLM's engine the version already."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version: expected an int >= 0, got {version!r}")
        self._version = version
        engine = getattr(self.llm, "llm_engine", None)
        if not engine_stamped and hasattr(engine, "set_weight_version"):  # vLLM's stamp (metrics, logs)
            engine.set_weight_version(str(version))

    def pause(self, timeout_s: float | None = None) -> None:
        """Hold back new generate calls and wait until the one in flight has finished."""
        with self._cond:
            self._paused = True
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                self._paused = False
                self._cond.notify_all()
                raise TimeoutError(f"pause: generation still in flight after {timeout_s} s")

    def resume(self) -> None:
        """Let generate calls run again (after a weight update)."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    # ---- sleep / wake (colocated mode) -----------------------------------------------------

    @property
    def sleep_supported(self) -> bool:
        """True when sleep() really frees memory (engine built with sleep mode on a platform with it)."""
        return self._sleep_supported and self.cfg.enable_sleep_mode

    def sleep(self, level: int = 1) -> bool:
        """Free the KV cache (level 1: and offload weights; level 2: drop weights).

        Returns whether memory was actually freed; where the platform has no sleep mode this
        logs why and frees nothing, but the engine still refuses to generate until wake_up().
        """
        if level not in (1, 2):
            raise ValueError(f"level: expected 1 or 2, got {level!r}")
        self.pause()
        self._asleep = True
        if not self.sleep_supported:
            logger.warning("rollout.sleep: nothing freed (%s); the engine stays resident.",
                           "the platform has no vLLM sleep mode" if not self._sleep_supported
                           else "engine built with enable_sleep_mode=False")
            return False
        self.llm.sleep(level=level)
        return True

    def wake_up(self) -> None:
        if self._asleep and self.sleep_supported:
            self.llm.wake_up()
        self._asleep = False
        self.resume()

    # ---- generation ------------------------------------------------------------------------

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) through the tokenizer's chat template."""
        return encode_chat(self.llm.get_tokenizer(), messages, source=f"prompts ({self.model_dir})")

    def _prompt_ids(self, prompts: Sequence) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
                out.append(self.tokenize_chat(list(p)))
            elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p):
                out.append([int(t) for t in p])
            else:
                raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids or of chat "
                                 f"messages, got {type(p).__name__} {str(p)[:60]!r}")
        return out

    def _enter(self) -> int:
        with self._cond:
            if self._asleep:
                raise RuntimeError("generate: the rollout engine is asleep; call wake_up() first")
            self._cond.wait_for(lambda: not self._paused)
            self._in_flight += 1
            return self._version

    def _exit(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def generate(self, prompts: Sequence, sampling: SamplingConfig | None = None,
                 data: Sequence[dict] | None = None, seeds: Sequence[int] | None = None) -> list[Sample]:
        """n samples per prompt, prompt-major (prompt 0's n samples first).

        `prompts`: token-id lists, or chat message lists. `data[i]` is attached to prompt i's samples.
        Seeding: with `seeds` (one per prompt) or `sampling.seed` set, sample j of prompt i is its own
        request seeded with `sample_seed(seed_i, j)` (seed_i = `sample_seed(sampling.seed, i)` when
        no `seeds` are given): samples are reproducible and independent of each other, of how the
        prompts are batched, and of the other prompts. Without either, vLLM's own stream is used.
        """
        sampling = sampling or SamplingConfig()
        if data is not None and len(data) != len(prompts):
            raise ValueError(f"data: expected one dict per prompt ({len(prompts)}), got {len(data)}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: expected one seed per prompt ({len(prompts)}), got {len(seeds)}")
        prompt_ids = self._prompt_ids(prompts)
        if not self.cfg.per_sample_seeds:
            seeds, sampling = None, dataclasses.replace(sampling, seed=None)
        requests, owners = self._requests(prompt_ids, sampling, seeds, self.cfg)
        version = self._enter()
        salt = prefix_cache_salt(version)
        inputs = [{"prompt_token_ids": prompt_ids[i], "cache_salt": salt} for i in owners]
        try:
            outputs = self.llm.generate(inputs, requests, use_tqdm=self.cfg.use_tqdm)
        finally:
            self._exit()
        with_logprobs = sampling.logprobs
        return [self._to_sample(prompt_ids[i], c, version, i, data[i] if data else {}, with_logprobs)
                for i, out in zip(owners, outputs) for c in out.outputs]

    @staticmethod
    def _requests(prompt_ids, sampling: SamplingConfig, seeds, cfg: RolloutConfig) -> tuple[list, list[int]]:
        """vLLM sampling params per request and the prompt each request belongs to (prompt-major)."""
        options = dict(detokenize=cfg.detokenize, logprobs=0 if sampling.logprobs else None)
        if seeds is None and sampling.seed is None:
            params = to_sampling_params(sampling, **options)
            return [params] * len(prompt_ids), list(range(len(prompt_ids)))
        if seeds is None:
            seeds = [sample_seed(sampling.seed, i) for i in range(len(prompt_ids))]
        one = dataclasses.replace(sampling, n=1)
        params, owners = [], []
        for i, seed in enumerate(seeds):
            for j in range(sampling.n):
                params.append(to_sampling_params(dataclasses.replace(one, seed=sample_seed(seed, j)),
                                                 **options))
                owners.append(i)
        return params, owners

    @staticmethod
    def _to_sample(prompt_ids, completion, version, group_id, data, with_logprobs: bool = True) -> Sample:
        ids = [int(t) for t in completion.token_ids]
        if not with_logprobs:
            return Sample(prompt_ids=list(prompt_ids), response_ids=ids, response_logprobs=None,
                          finish_reason=str(completion.finish_reason), weight_version=version,
                          group_id=group_id, data=dict(data))
        steps = completion.logprobs
        if steps is None or len(steps) != len(ids):
            raise RuntimeError(f"generate: vLLM returned no per-token logprobs for prompt {group_id}")
        # each step's entries begin with the sampled token
        firsts = steps.start_indices
        if [steps.token_ids[i] for i in firsts] != ids:
            raise RuntimeError(f"generate: vLLM's logprobs of prompt {group_id} "
                               "are not of its sampled tokens")
        logprobs = [float(steps.logprobs[i]) for i in firsts]
        return Sample(prompt_ids=list(prompt_ids), response_ids=ids, response_logprobs=logprobs,
                      finish_reason=str(completion.finish_reason), weight_version=version,
                      group_id=group_id, data=dict(data))

    def shutdown(self) -> None:
        """Stop the engine's worker processes (their accelerator memory is freed with them)."""
        shutdown_llm(self.llm)


def prefix_cache_salt(version: int) -> str:
    """vLLM's `cache_salt` of every request generated with weights of `version`.

    A cached prefix block's hash starts from its request's salt, so a request of one version never
    reuses KV computed with another version's weights, and a weight sync need not reset the prefix
    cache: that reset walks every KV block in the engine core (5.5 ms for ~21K blocks on an H200,
    more than half of a 1.7B model's transfer). Old blocks are evicted as the cache needs room.
    """
    return f"opkd-weights-{version}"


def shutdown_llm(llm) -> None:
    """Stop a `vllm.LLM`'s engine core and workers now, rather than whenever it is collected: the
    next engine on the same device can only start once this one's memory is back."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
