"""Top-k teacher rows computed inside the vLLM engine, on its device: `teacher.teachers.N.scoring: device`.

Why this path. vLLM's `prompt_logprobs` turns every scored position into Python objects (k+1
entries each) before the driver sees them; for 34K tokens of a 1.7B teacher that took 2.66 s on an
H200 whose forward is ~0.15 s. Three ways around it were weighed, on the two vLLM releases the
project runs (0.26 on GPUs, 0.32 on CPUs):

* a direct forward through the model runner with hand-built prefill attention metadata: the
  metadata builders differ per attention backend and per release; rejected as fragile;
* hidden states to the driver (the `output: hidden` pooling engine) and the LM head plus the top-k
  on the trainer's device: simple, but the engine's output path then carries `H x 4` bytes per
  token (the pooler's float32 head output) and the trainer's device holds the whole output weight
  and the chunk logits, beside the student;
* the same pooling engine, with the LM head and the top-k applied to its pooler's output inside
  the worker (chosen). The engine runs as the `output: hidden` teacher does (`runner="pooling"`,
  every position's final-norm hidden state), and this module's worker extension wraps the model's
  pooler: each finished request's hidden states go through the output weight, a float32
  log-softmax at the teacher temperature and `torch.topk` on the device, and only the packed rows
  `[L-1, 2K]` (512 bytes per token at K=64, against 8 KB of hidden states at H=2048) travel to the
  driver. It relies only on what the project relies on already in both releases: the pooler's
  `forward(hidden_states, pooling_metadata) -> list[Tensor | None]` (one entry per request, None
  until a chunked prefill finishes), `worker_extension_cls` and `LLM.collective_rpc`.

What it computes. For positions t = 0..L-2 of a sequence, z = h_t W^T (the GEMM in the engine's
dtype, as vLLM's LM head does it), then in float32 `log_softmax(z / T)` over the whole vocabulary
and its top-k, ordered by value: at T = 1 exactly what `prompt_logprobs` computes (vLLM's raw
logprobs are `log_softmax(z, dtype=float32)`), at T != 1 the exact tempered distribution. The
engine is sent the sequence without its last token (`hidden_states.pooled_input`: that position
scores nothing), so a sequence of up to the engine's `max_model_len` tokens is scored whole. The
output weight (`lm_head.weight`, or the embedding when tied) is read from the engine's checkpoint
when the scorer is installed, in the engine's dtype: an engine whose weights change afterwards (a
rollout engine receiving the student) must not use this path.

Ties. Values that are exactly equal (frequent with bf16 logits) come out in `torch.topk`'s order,
which is unspecified, as they do from `prompt_logprobs` (which also uses `topk`): two paths agree
on ids exactly except among entries of equal value, and at the k-th place on which of several equal
values is kept. Tests compare them that way (`tests/test_teacher_device_topk.py`).

Tensor parallelism. With a TP engine each rank reads its contiguous block of the vocabulary's rows
(vocabulary padded up to a multiple of the TP size; padding rows are masked), computes its local
log-normaliser and local top-k, and one all-gather over vLLM's TP group of `[n, 2K+1]` values per
row gives every rank the global normaliser and the global top-k: no rank forms more than its share
of the logits. Every rank runs the pooler on the same batch, so the collective calls match.

Logits that are not `h W^T` (soft-capping, a logit scale, a bias) are not computed here: such
checkpoints are refused by `device_scoring_blocker`, and `scoring: auto` keeps `prompt_logprobs`
for them.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable

import torch

from opkd_mcore.losses.teacher_outputs import PAD_ID, MalformedTeacherOutputError, TopKTeacher
from opkd_mcore.models.weights import _SafetensorsIndex
from opkd_mcore.teacher.hidden_states import load_output_weight_shard, output_weight_name

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "opkd_mcore.teacher.device_topk.DeviceTopKWorker"
# float32 logits formed at once per rank: rows per chunk = this / V_local (256 MB; with the GEMM's
# bf16 output and logsumexp's temporary a chunk holds about 2.5x that beyond the engine's memory)
CHUNK_LOGITS = 1 << 26
# ids travel in the float32 rows: exact below 2^24
MAX_VOCAB = 1 << 24
# config keys that change the logits beyond h W^T (Gemma soft-capping, Cohere / Granite scales,
# MiniCPM's width scaling): such teachers keep prompt_logprobs
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "scale_width",
                     "output_multiplier_scale")


def device_scoring_blocker(model_dir: str) -> str | None:
    """Why the device scorer cannot reproduce this checkpoint's logits, or None when it can: its
    logits must be the output weight's product alone, and that weight a safetensors tensor."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return f"{path} is unreadable ({err})"
    for key in _LOGIT_TRANSFORMS:
        if config.get(key) not in (None, 1, 1.0):
            return f"{path} sets {key}={config[key]} (logits are not the output weight's product alone)"
    if int(config.get("vocab_size", 0)) >= MAX_VOCAB:
        return f"{path}: vocab_size {config['vocab_size']} >= 2^24 (ids travel as float32)"
    try:
        tensors = _SafetensorsIndex(model_dir).files
        name, _ = output_weight_name(model_dir)
    except (OSError, ValueError, KeyError) as err:
        return f"{model_dir}: no output weight to read from a safetensors checkpoint ({err!r})"
    if name not in tensors:
        return f"{model_dir}: the checkpoint has no {name!r} (the output weight, read by that name)"
    if "lm_head.bias" in tensors:
        return f"{model_dir}: the LM head has a bias"
    return None


# ---- the math (no vLLM) ---------------------------------------------------------------------

Gather = Callable[[torch.Tensor], torch.Tensor]  # [n, c] -> [n, c * tp], rank order along dim 1


@torch.no_grad()
def topk_logprobs(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, *, k: int, temperature: float,
                  vocab_start: int = 0, vocab_size: int | None = None, gather: Gather | None = None,
                  chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `log_softmax(hidden @ weight.T / temperature)` over the full vocabulary.

    `weight_VH` holds rows `[vocab_start, vocab_start + V_local)` of the output weight; rows at or past
    `vocab_size` are padding (probability 0). `gather` all-gathers `[n, c]` tensors over the ranks
    that hold the other rows (None: this one holds them all). Returns float32 logprobs `[N, K]`
    sorted descending and int64 ids `[N, K]` (padding -1 / -inf when the vocabulary has fewer than k
    ids).
    """
    v_local = weight_VH.shape[0]
    valid = v_local if vocab_size is None else max(0, min(v_local, vocab_size - vocab_start))
    rows = chunk_rows or max(1, CHUNK_LOGITS // max(v_local, 1))
    values, ids = [], []
    for lo in range(0, hidden_NH.shape[0], rows):
        h = hidden_NH[lo:lo + rows].to(weight_VH.dtype)
        z = torch.nn.functional.linear(h, weight_VH).float()
        if temperature != 1.0:
            z.div_(temperature)
        if valid < v_local:
            z[:, valid:] = -math.inf
        v, i = _chunk_topk(z, k, vocab_start, gather)
        values.append(v)
        ids.append(i)
    if not values:
        return (torch.empty(0, k, dtype=torch.float32, device=hidden_NH.device),
                torch.empty(0, k, dtype=torch.int64, device=hidden_NH.device))
    return torch.cat(values), torch.cat(ids)


def _chunk_topk(z: torch.Tensor, k: int, vocab_start: int, gather: Gather | None):
    """(logprobs, ids) `[n, k]` of one chunk of float32 logits `[n, V_local]`."""
    width = min(k, z.shape[1])
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    top, idx = z.topk(width, dim=1)
    idx = idx + vocab_start
    if gather is not None:
        # one collective: [local lse | local top-k values | local ids, exact as float32 below 2^24]
        packed = gather(torch.cat([lse, top, idx.float()], dim=1))
        tp = packed.shape[1] // (2 * width + 1)
        packed = packed.view(z.shape[0], tp, 2 * width + 1)
        lse = torch.logsumexp(packed[:, :, 0], dim=1, keepdim=True)
        cand_v = packed[:, :, 1:1 + width].reshape(z.shape[0], -1)
        cand_i = packed[:, :, 1 + width:].reshape(z.shape[0], -1)
        width = min(k, cand_v.shape[1])
        top, pick = cand_v.topk(width, dim=1)
        idx = cand_i.gather(1, pick).long()
    logprobs = top - lse
    ids = torch.where(torch.isfinite(top), idx, PAD_ID)
    if width < k:  # a vocabulary smaller than k
        logprobs = torch.nn.functional.pad(logprobs, (0, k - width), value=-math.inf)
        ids = torch.nn.functional.pad(ids, (0, k - width), value=PAD_ID)
    return logprobs, ids


def pack_rows(logprobs_NK: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
    """`[N, 2K]` float32: logprobs, then ids (exact as float32 below 2^24; padding -1)."""
    return torch.cat([logprobs_NK.float(), ids_NK.float()], dim=1)


def unpack_rows(packed: torch.Tensor, k: int, vocab_size: int, where: str) -> TopKTeacher:
    """`pack_rows`' output -> `TopKTeacher`; MalformedTeacherOutputError naming `where` on a wrong
    shape or dtype, or rows that fail `check_topk_rows`."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.shape[1] != 2 * k \
            or packed.dtype != torch.float32:
        got = (tuple(packed.shape), packed.dtype) if isinstance(packed, torch.Tensor) else type(packed)
        raise MalformedTeacherOutputError(
            f"{where}: expected float32 top-k rows [L-1, {2 * k}] (logprobs, ids), got {got}; is the "
            "engine's device scorer installed with this k?")
    ids_f = packed[:, k:]
    ids = ids_f.long()
    if not torch.equal(ids_f, ids.float()):
        t = int((ids_f != ids).any(1).nonzero()[0])
        raise MalformedTeacherOutputError(f"{where}, position {t}: ids that are not integers: "
                                          f"{ids_f[t].tolist()}")
    logprobs = packed[:, :k].contiguous()
    check_topk_rows(ids, logprobs, vocab_size, where)
    return TopKTeacher(ids=ids, logprobs=logprobs)


def check_topk_rows(ids: torch.Tensor, logprobs: torch.Tensor, vocab_size: int, where: str) -> None:
    """MalformedTeacherOutputError naming `where` and the first bad position for ids outside
    `[0, vocab_size)` other than the padding -1, NaN or positive logprobs, or padding with a logprob
    other than -inf."""
    pad = ids == PAD_ID
    bad_id = ((ids < 0) | (ids >= vocab_size)) & ~pad
    bad_value = logprobs.isnan() | (logprobs > 1e-4) | (pad & (logprobs != -math.inf))
    if bad_id.any() or bad_value.any():
        t = int((bad_id | bad_value).any(1).nonzero()[0])
        raise MalformedTeacherOutputError(
            f"{where}, position {t}: expected ids in [0, {vocab_size}) (or -1 padding) and logprobs "
            f"<= 0, got ids {ids[t].tolist()} and logprobs {logprobs[t].tolist()}")


# ---- inside the engine ------------------------------------------------------------------------

class DeviceTopKWorker:
    """vLLM worker extension (`worker_extension_cls=WORKER_EXTENSION`): reached with
    `llm.collective_rpc("opkd_topk_scorer", args=(k, temperature))` on a pooling engine.

    The first call reads this rank's output-weight rows from the engine's checkpoint and wraps the
    model's pooler; every call sets k and the temperature the following requests are scored with
    (an engine scores for one teacher at a time). Returns what the driver checks: vocabulary size,
    TP size and the settings in force."""

    def opkd_topk_scorer(self, k: int, temperature: float) -> dict:
        if int(k) < 1 or not float(temperature) > 0:
            raise ValueError(f"device top-k scorer: expected k >= 1 and temperature > 0, got k={k}, "
                             f"temperature={temperature}")
        state = getattr(self, "_opkd_topk", None)
        if state is None:
            state = self._opkd_install_topk()
        state.update(k=int(k), temperature=float(temperature))
        return {"vocab_size": state["vocab_size"], "tp_size": state["tp_size"], "k": state["k"],
                "temperature": state["temperature"]}

    def _opkd_install_topk(self) -> dict:
        from vllm.distributed import get_tp_group

        model = self.model_runner.model
        pooler = getattr(model, "pooler", None)
        if pooler is None:
            raise TypeError("device top-k scorer: the engine's model has no pooler; build the engine with "
                            "runner='pooling' (teacher/hidden_states.engine_kwargs)")
        model_dir, vocab = self.model_config.model, int(self.model_config.get_vocab_size())
        group = get_tp_group()
        tp, rank = group.world_size, group.rank_in_group
        padded = -(-vocab // tp) * tp
        device = next(model.parameters()).device
        weight = load_output_weight_shard(model_dir, padded, rank, tp, self.model_config.dtype, device)
        state = {"vocab_size": vocab, "tp_size": tp, "weight": weight, "vocab_start": rank * (padded // tp)}
        gather = (lambda x: group.all_gather(x.contiguous(), dim=1)) if tp > 1 else None
        original = pooler.forward

        def forward(*args, **kwargs):
            return score_pooled(original(*args, **kwargs), state, gather)

        pooler.forward = forward  # instance attribute: shadows the class's forward
        self._opkd_topk = state
        logger.info("device top-k scorer on %s: output weight rows %s of %d (TP rank %d/%d)", device,
                    tuple(weight.shape), vocab, rank, tp)
        return state


def score_pooled(outputs: list, state: dict, gather: Gather | None) -> list:
    """The pooler's per-request hidden states `[N, H]` (None while a chunked prefill is unfinished;
    N = L-1: a sequence is sent without its last token) -> packed top-k rows `[N, 2K]` of the finished
    ones, in one batch of GEMMs."""
    if not isinstance(outputs, list):
        raise TypeError(f"device top-k scorer: expected the pooler's list of per-request hidden states, "
                        f"got {type(outputs).__name__}")
    done = [i for i, out in enumerate(outputs) if out is not None]
    if not done:
        return outputs
    states = [outputs[i] for i in done]
    logprobs, ids = topk_logprobs(torch.cat(states), state["weight"], k=state["k"],
                                  temperature=state["temperature"], vocab_start=state["vocab_start"],
                                  vocab_size=state["vocab_size"], gather=gather)
    rows = pack_rows(logprobs, ids).split([s.shape[0] for s in states])
    scored = list(outputs)
    for i, r in zip(done, rows):
        scored[i] = r
    return scored
