"""In-process vLLM teacher: top-k rows (`TopKTeacher`) or hidden states over prompt+response.

Top-k rows come one of two ways (`scoring`):

* `device` (`auto`'s choice for a checkpoint whose logits are its output weight's product, which the
  project's families all are): the engine runs as a pooling model, and a worker extension applies
  the output weight, the tempered log-softmax and the top-k on the engine's device; packed tensors
  come back (`teacher/device_topk.py`, which says why this way). Every sequence of up to
  `max_model_len` tokens is scored whole. Exact at any temperature; TP engines shard the vocabulary.
* `prompt_logprobs` (any checkpoint vLLM runs, an engine passed in with the generate runner):

A sequence of L tokens is sent without its last token: the prompt logprobs of those L-1 tokens
score tokens 1..L-2, and the logprobs of the one token sampled after them (raw, like prompt
logprobs: vLLM's default `logprobs_mode`) are the row that scores token L-1. The engine then holds
every sequence of up to its `max_model_len` tokens, a sample that fills the rollout's context
included: vLLM's generate runner refuses a prompt that leaves no room for one output token, and a
context one position longer may exceed what the model allows.

vLLM's prompt logprobs come before any sampling processor, i.e. at temperature 1. A teacher
temperature T != 1 is honoured exactly by asking for the whole vocabulary and re-normalising
`log_softmax(logprob / T)` in float64 before taking the top-k (costlier: V entries per position).
vLLM builds Python objects per position and entry on this path: on an H200, 2.66 s for 34K tokens
of a 1.7B teacher whose forward is ~0.15 s of GPU work.

`output="hidden"`: the engine runs as a pooling model and returns every position's final-norm
hidden state (bf16 `HiddenTeacher` rows, `teacher/hidden_states.py`); the loss applies the
teacher's output weight (exact dense KD; temperature is then the loss's, like a dense teacher's).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from opkd_mcore.config.schema import TEACHER_SCORINGS
from opkd_mcore.losses.teacher_outputs import HiddenTeacher, TopKTeacher
from opkd_mcore.platform import is_cpu
from opkd_mcore.rollout.engine_env import child_pids, engine_environment, yield_cpu_to_trainer
from opkd_mcore.rollout.vllm_rollout import shutdown_llm
from opkd_mcore.teacher.base import Teacher, check_outputs, check_sequences, topk_from_flat
from opkd_mcore.teacher.device_topk import WORKER_EXTENSION, device_scoring_blocker, unpack_rows
from opkd_mcore.teacher.hidden_states import POOLING_TASK, engine_kwargs, pooled_input, rows_from_states

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class VllmTeacherConfig:
    """Settings of an in-process vLLM teacher."""

    k: int = 20  # top-k entries per scored position
    temperature: float = 1.0  # teacher temperature (exact; != 1 scores the full vocabulary)
    tensor_parallel_size: int = 1  # vLLM TP of the teacher engine
    dtype: str = "auto"  # engine dtype ("auto" = checkpoint's)
    max_model_len: int | None = None  # longest sequence scored (prompt+response); None = checkpoint's
    gpu_memory_utilization: float = 0.3  # accelerator share (ignored on CPU)
    seed: int = 0  # engine seed (scoring is deterministic anyway)
    use_tqdm: bool = False  # vLLM's progress bar per score call
    extra_engine_kwargs: dict = field(default_factory=dict)  # passed to vllm.LLM as is
    output: str = "topk"  # topk: TopKTeacher rows | hidden: final-norm hidden states (HiddenTeacher rows)
    # top-k rows by: device (on the engine's device, teacher/device_topk.py) | prompt_logprobs |
    # auto (device where it reproduces the checkpoint's logits, see the module docstring)
    scoring: str = "auto"

    def validate(self) -> None:
        if self.output not in ("topk", "hidden"):
            raise ValueError(f"teacher.output: expected 'topk' or 'hidden', got {self.output!r}")
        if self.scoring not in TEACHER_SCORINGS:
            raise ValueError(f"teacher.scoring: expected one of {TEACHER_SCORINGS}, got {self.scoring!r}")
        if self.output == "hidden" and self.scoring != "auto":
            raise ValueError(f"teacher.scoring: {self.scoring!r} chooses how top-k rows are computed; "
                             "a teacher with output 'hidden' sends hidden states (leave it 'auto')")
        if self.output == "hidden" and self.temperature != 1.0:
            raise ValueError("teacher.temperature: hidden states carry no temperature (the loss's "
                             f"loss.temperature applies to the logits it forms); got {self.temperature}")
        if self.k < 1:
            raise ValueError(f"teacher.k: expected >= 1, got {self.k}")
        if self.temperature <= 0:
            raise ValueError(f"teacher.temperature: expected > 0, got {self.temperature}")


def _engine_limits(llm) -> tuple[int, int]:
    """(max_logprobs, vocab_size) of a built vLLM engine; max_logprobs -1 means unlimited."""
    model_config = llm.llm_engine.model_config
    return int(model_config.max_logprobs), int(model_config.get_vocab_size())


class VllmTeacher(Teacher):
    """Scores sequences with an in-process `vllm.LLM` (built from `model`, or an existing engine).

    An engine passed in is scored as it was built: a pooling engine with the device scorer's worker
    extension (`runner="pooling"`, `worker_extension_cls=device_topk.WORKER_EXTENSION`, the
    `hidden_states.engine_kwargs` pooler) by `device`; a generate engine by `prompt_logprobs`, which
    needs `max_logprobs >= k` (or the vocabulary size when temperature != 1), no prefix caching,
    which would skip cached positions, and raw logprobs (`logprobs_mode="raw_logprobs"`, vLLM's
    default: the last row is a sampled token's).
    """

    def __init__(self, model, cfg: VllmTeacherConfig | None = None):
        self.cfg = cfg or VllmTeacherConfig()
        self.cfg.validate()
        if isinstance(model, str):
            self._address = model
            self.scoring = self._scoring_for_checkpoint(model)
            self.llm = self._build_engine(model)
            self._owns_engine = True
        else:
            self._owns_engine = False
            self._address = f"in-process engine of {model.llm_engine.model_config.model}"
            self.llm = model
            self.scoring = self._scoring_for_engine(model)
        self.max_logprobs, self.vocab_size = _engine_limits(self.llm)
        if self.scoring == "prompt_logprobs":
            self._check_logprobs_engine()
        elif self.scoring == "device":
            self._set_device_scorer()
        if self.scoring != "hidden":
            how = "the engine's device scorer" if self.scoring == "device" else "vLLM's prompt_logprobs"
            logger.info("teacher %s: top-%d rows by %s", self._address, self.cfg.k, how)

    def close(self) -> None:
        """Stop the engine this teacher built (an engine passed in belongs to the caller)."""
        if self._owns_engine:
            shutdown_llm(self.llm)

    @property
    def _full_vocab(self) -> bool:
        return self.cfg.temperature != 1.0

    @property
    def address(self) -> str:
        return self._address

    def _scoring_for_checkpoint(self, model_dir: str) -> str:
        """hidden | device | prompt_logprobs for an engine this teacher builds."""
        cfg = self.cfg
        if cfg.output == "hidden" or cfg.scoring == "prompt_logprobs":
            return "hidden" if cfg.output == "hidden" else "prompt_logprobs"
        blocker = device_scoring_blocker(model_dir)
        if blocker is None:
            return "device"
        if cfg.scoring == "device":
            raise ValueError(f"teacher.scoring: 'device' cannot reproduce the logits of {model_dir}: "
                             f"{blocker}; use 'prompt_logprobs' (or 'auto')")
        logger.info("teacher %s: top-k rows by prompt_logprobs, not on the device: %s", model_dir, blocker)
        return "prompt_logprobs"

    def _scoring_for_engine(self, llm) -> str:
        """hidden | device | prompt_logprobs for an engine passed in: what it was built for."""
        if self.cfg.output == "hidden":
            return "hidden"
        runner = llm.llm_engine.model_config.runner_type
        built_for = "device" if runner == "pooling" else "prompt_logprobs"
        if self.cfg.scoring not in ("auto", built_for):
            raise ValueError(
                f"teacher.scoring: {self.cfg.scoring!r} needs an engine built for it; {self._address} runs "
                f"vLLM's {runner!r} runner (device: runner='pooling' with worker_extension_cls="
                f"{WORKER_EXTENSION!r}; prompt_logprobs: the generate runner)")
        return built_for

    def _check_logprobs_engine(self) -> None:
        needed = self.vocab_size if self._full_vocab else self.cfg.k
        if self.max_logprobs != -1 and self.max_logprobs < needed:
            raise ValueError(
                f"teacher.k: {self._address} returns at most {self.max_logprobs} logprobs per "
                f"position, {needed} needed (k={self.cfg.k}, temperature={self.cfg.temperature}); "
                "build the engine with a larger max_logprobs")
        mode = self.llm.llm_engine.model_config.logprobs_mode
        if mode != "raw_logprobs":
            raise ValueError(f"teacher engine: {self._address} reports {mode!r} logprobs; the last row of "
                             "each sequence is a sampled token's logprobs, which must be 'raw_logprobs' "
                             "like the prompt logprobs of the others")

    def _set_device_scorer(self) -> None:
        """k and the temperature of the engine's device scorer (installed by the first call). Set
        before every call too: teachers sharing an engine (one at a time) each get their own."""
        try:
            answers = self.llm.collective_rpc("opkd_topk_scorer", args=(self.cfg.k, self.cfg.temperature))
        except Exception as err:  # vLLM re-raises a worker's error as its own types, per release
            raise RuntimeError(f"teacher engine: {self._address} could not set up its device top-k scorer "
                               f"(built with worker_extension_cls={WORKER_EXTENSION!r}?): {err}") from err
        vocabs = {a["vocab_size"] for a in answers}
        if vocabs != {self.vocab_size}:
            raise RuntimeError(f"teacher engine: {self._address}: its workers score vocabularies {vocabs}, "
                               f"the engine's is {self.vocab_size}")

    def _build_engine(self, model_dir: str):
        from vllm import LLM

        cfg = self.cfg
        if self.scoring == "hidden":
            mode = engine_kwargs()
        elif self.scoring == "device":
            mode = dict(engine_kwargs(), worker_extension_cls=WORKER_EXTENSION)
        else:
            mode = dict(max_logprobs=-1 if self._full_vocab else cfg.k)

        before = child_pids()
        with engine_environment():  # inside a torchrun job: the engine is a job of its own
            llm = LLM(model=model_dir, tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.dtype,
                      max_model_len=cfg.max_model_len, gpu_memory_utilization=cfg.gpu_memory_utilization,
                      enforce_eager=True, seed=cfg.seed, enable_prefix_caching=False, **mode,
                      **cfg.extra_engine_kwargs)
        if is_cpu():
            yield_cpu_to_trainer(before)
        return llm

    def score(self, sequences: Sequence[Sequence[int]]) -> list[TopKTeacher] | list[HiddenTeacher]:
        from vllm import SamplingParams

        seqs = check_sequences(sequences)
        if self.scoring == "hidden":
            return self._score_hidden(seqs)
        if self.scoring == "device":
            return self._score_device(seqs)
        request_k = self.vocab_size if self._full_vocab else self.cfg.k
        # detokenize=False: no decoded string per top-k entry, which dominates the cost at large k;
        # flat_logprobs: a few flat lists per sequence instead of a dict of objects per position
        # (128 x 300 tokens at k=64 on CPU: vLLM's part 3.8-5.9 s -> 0.6 s)
        # the last token is not sent: the sampled token's logprobs score it (see the module docstring)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=request_k, logprobs=request_k,
                                detokenize=False, flat_logprobs=True)
        outputs = self.llm.generate([{"prompt_token_ids": s[:-1]} for s in seqs], params,
                                    use_tqdm=self.cfg.use_tqdm)
        scored = [self._rows(s, out, i) for i, (s, out) in enumerate(zip(seqs, outputs))]
        check_outputs(seqs, scored, self._address)
        return scored

    def _score_device(self, seqs: list[list[int]]) -> list[TopKTeacher]:
        self._set_device_scorer()
        outputs = self.llm.encode([{"prompt_token_ids": pooled_input(s)} for s in seqs],
                                  pooling_task=POOLING_TASK, use_tqdm=self.cfg.use_tqdm)
        scored = [unpack_rows(out.outputs.data, self.cfg.k, self.vocab_size, f"{self._address}: sequence {i}")
                  for i, out in enumerate(outputs)]
        check_outputs(seqs, scored, self._address)
        return scored

    def _score_hidden(self, seqs: list[list[int]]) -> list[HiddenTeacher]:
        outputs = self.llm.encode([{"prompt_token_ids": pooled_input(s)} for s in seqs],
                                  pooling_task=POOLING_TASK, use_tqdm=self.cfg.use_tqdm)
        scored = [rows_from_states(s, out.outputs.data, f"{self._address}: sequence {i}")
                  for i, (s, out) in enumerate(zip(seqs, outputs))]
        check_outputs(seqs, scored, self._address)
        return scored

    def _rows(self, seq: list[int], output, index: int) -> TopKTeacher:
        request = f"{self._address}: sequence {index}"
        prompt_logprobs = output.prompt_logprobs
        if prompt_logprobs is None or len(prompt_logprobs) != len(seq) - 1:
            got = None if prompt_logprobs is None else len(prompt_logprobs)
            raise TypeError(f"{request}: expected {len(seq) - 1} prompt-logprob positions, got {got}")
        sampled = output.outputs[0].logprobs if output.outputs else None
        if sampled is None or len(sampled) != 1:
            got = None if sampled is None else len(sampled)
            raise TypeError(f"{request}: expected the logprobs of 1 sampled token, got {got}")
        # positions 1.. of the prompt (position 0 has nothing before it), then the sampled token's
        parts = [_flat_entries(prompt_logprobs, request, first=1), _flat_entries(sampled, request, first=0)]
        ids, logprobs, ranks, counts = (a + b for a, b in zip(*parts))
        if self._full_vocab:
            return self._tempered_rows(ids, logprobs, counts, request)
        return topk_from_flat(ids, logprobs, ranks, counts, self.cfg.k, request=request,
                              vocab_size=self.vocab_size)

    def _tempered_rows(self, ids: list[int], logprobs: list[float], counts: list[int],
                       request: str) -> TopKTeacher:
        full = torch.full((len(counts), self.vocab_size), float("-inf"), dtype=torch.float64)
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
        full[rows, torch.tensor(ids, dtype=torch.int64)] = torch.tensor(logprobs, dtype=torch.float64)
        tempered = torch.log_softmax(full / self.cfg.temperature, dim=-1)
        width = min(self.cfg.k, self.vocab_size)
        values, top = tempered.topk(width, dim=-1)
        return topk_from_flat(top.flatten(), values.flatten(), torch.arange(1, width + 1).repeat(len(counts)),
                              [width] * len(counts), self.cfg.k, request=request, vocab_size=self.vocab_size)


def _flat_entries(flat, request: str, first: int) -> tuple[list[int], list[float], list[int], list[int]]:
    """(ids, logprobs, ranks, entries per position) of positions `first`.. of vLLM's flat (prompt
    or sample) logprobs."""
    starts, ends = flat.start_indices[first:], flat.end_indices[first:]
    if not starts:
        return [], [], [], []
    lo, hi = starts[0], ends[-1]
    counts = [e - s for s, e in zip(starts, ends)]
    if sum(counts) != hi - lo:
        raise TypeError(f"{request}: flat logprobs not contiguous ({sum(counts)} entries in {lo}..{hi})")
    return flat.token_ids[lo:hi], flat.logprobs[lo:hi], flat.ranks[lo:hi], counts
