"""Dense Megatron teacher: a forward-only GPTModel in the student's parallel layout.

The teacher is built on the same Megatron groups as the student (call `init_parallel` first), so
its logits come out TP-sharded exactly like the student's: rank r of the TP group holds vocabulary
ids `[r*V_local, (r+1)*V_local)`, ready for `kd_loss` with a `DenseTeacher`. With `k` set, the
global top-k over all shards is returned instead (identical on every TP rank). Scores exist on the
last pipeline stage only; other stages get `None` per sequence. No gradients, no optimizer state;
`offload()` moves the weights to host memory between uses and `score` brings them back.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from opkd_mcore import platform
from opkd_mcore.engine.megatron_engine import MegatronEngine
from opkd_mcore.engine.packing import pack_sequences, split_by_token_budget
from opkd_mcore.losses.teacher_outputs import DenseTeacher, TopKTeacher
from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
from opkd_mcore.teacher.base import Teacher, TeacherOutput, check_outputs, check_sequences

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MegatronTeacherConfig:
    """Settings of the dense Megatron teacher."""

    k: int | None = None  # None: dense TP-sharded logits; int: global top-k ids + logprobs
    temperature: float = 1.0  # logits are divided by it (dense) / logprobs re-normalised (top-k)
    max_tokens_per_micro_batch: int = 4096  # packed tokens per forward micro-batch
    params_dtype: torch.dtype | None = None  # None: fp32 on CPU, bf16 on accelerators
    offload_between_calls: bool = False  # keep weights in host memory while not scoring
    padded_vocab: int | None = None  # vocabulary rows of the output layer (None: the model's own
    # padding); a teacher inside the student's step uses the student's so the shards line up

    def validate(self) -> None:
        if self.k is not None and self.k < 1:
            raise ValueError(f"teacher.k: expected None (dense) or >= 1, got {self.k}")
        if self.temperature <= 0:
            raise ValueError(f"teacher.temperature: expected > 0, got {self.temperature}")
        if self.max_tokens_per_micro_batch < 2:
            raise ValueError("teacher.max_tokens_per_micro_batch: expected >= 2, got "
                             f"{self.max_tokens_per_micro_batch}")


def vocab_parallel_topk(logits_local: torch.Tensor, k: int, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k `(ids [N, k], logprobs [N, k])` of TP-sharded logits `[N, V_local]`.

    Each rank takes its local top-k, the candidates are gathered over `group` and reduced again;
    the log-normaliser is a global logsumexp. Every rank returns the same result.
    """
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    x = logits_local.double()
    local_k = min(k, x.shape[-1])
    values, ids = x.topk(local_k, dim=-1)
    ids = ids + rank * x.shape[-1]
    lse = torch.logsumexp(x, dim=-1)
    if world > 1:
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        all_lse = [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        dist.all_gather(all_lse, lse.contiguous(), group=group)
        values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
        lse = torch.logsumexp(torch.stack(all_lse, dim=-1), dim=-1)
    top_values, where = values.topk(min(k, values.shape[-1]), dim=-1)
    return ids.gather(-1, where), (top_values - lse.unsqueeze(-1)).float()


class MegatronTeacher(Teacher):
    """Forward-only Megatron teacher loaded from a Hugging Face checkpoint (collective call)."""

    def __init__(self, hf_dir: str, cfg: MegatronTeacherConfig | None = None):
        self.cfg = cfg or MegatronTeacherConfig()
        self.cfg.validate()
        self.hf_dir = hf_dir
        chunks = build_model(load_hf_config(hf_dir), params_dtype=self.cfg.params_dtype,
                             padded_vocab=self.cfg.padded_vocab)
        load_hf_weights(chunks, hf_dir)
        self.engine = MegatronEngine(chunks, optim=None)
        self._offloaded = False
        if self.cfg.offload_between_calls:
            self.offload()

    @property
    def address(self) -> str:
        return f"megatron:{self.hf_dir}"

    @property
    def offloaded(self) -> bool:
        """True while the weights are in host memory."""
        return self._offloaded

    def offload(self) -> None:
        """Move the weights to host memory (frees accelerator memory between uses)."""
        for p in self.engine.parameters():
            p.data = p.data.to("cpu", non_blocking=True)
        self._offloaded = True

    def reload(self) -> None:
        device = platform.current_device()
        for p in self.engine.parameters():
            p.data = p.data.to(device, non_blocking=True)
        self._offloaded = False

    def score(self, sequences: Sequence[Sequence[int]]) -> list[TeacherOutput | None]:
        """Collective over the model-parallel group: every rank calls it with the same sequences."""
        seqs = check_sequences(sequences)
        if self._offloaded:
            self.reload()
        try:
            groups = split_by_token_budget([len(s) for s in seqs], self.cfg.max_tokens_per_micro_batch)
            batches = [pack_sequences([seqs[i] for i in g], [1] * len(g)) for g in groups]
            logits = self.engine.forward_logits_many(batches)
        finally:
            if self.cfg.offload_between_calls:
                self.offload()
        out: list[TeacherOutput | None] = [None] * len(seqs)
        if logits[0] is None:  # not the last pipeline stage
            return out
        for group, batch, z in zip(groups, batches, logits):
            starts = batch.cu_seqlens[:-1].tolist()
            for i, start in zip(group, starts):
                out[i] = self._rows(z[start:start + len(seqs[i]) - 1])
        check_outputs(seqs, out, self.address)
        return out

    def _rows(self, logits_local: torch.Tensor) -> TeacherOutput:
        from megatron.core import parallel_state as ps

        z = logits_local / self.cfg.temperature
        if self.cfg.k is None:
            return DenseTeacher(logits=z)
        ids, logprobs = vocab_parallel_topk(z, self.cfg.k, ps.get_tensor_model_parallel_group())
        return TopKTeacher(ids=ids, logprobs=logprobs)
