"""A dense Megatron teacher that runs inside the student's training step, micro-batch by micro-batch.

The teacher's GPTModel chunks are built on the student's parallel groups (same TP, the same PP
stages and VPP chunks), forward only: no optimizer, no DDP wrapper, no gradient buffers. For
every micro-batch the student's schedule runs, each stage runs its student chunk and its teacher
chunk on the same tokens:

    stage s (not last):  [student hidden | teacher hidden]  -- one p2p tensor -->  stage s+1
    last stage:          student logits [T, V_local] + teacher logits [T, V_local] -> kd_loss

The two hidden states travel as one tensor concatenated along the hidden dimension, so
Megatron's own p2p schedule (1F1B, interleaved) carries the teacher's activations with no extra
messages and in the same order; the teacher half is detached, so its gradient is never computed.
The teacher's TP-sharded logits therefore appear on the rank that computes the student's loss for
the same vocabulary shard, one micro-batch at a time (as many as the pipeline has in flight), and
nothing dense crosses ranks or processes.

A teacher with another tokenizer (`loss.cross_tokenizer`) runs on its own tokens: the micro-batch's
`CrossTokenizerTeacher` carries the teacher-side sequences, packed like the student's; every stage
runs the teacher chunk on that packing (`teacher_packing`), both padded to one length under a
pipeline so the two hidden states still travel as one tensor, and the last stage's teacher logits
(over the teacher's own vocabulary, sharded like the student's) become the rows the loss aligns.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from opkd_mcore.engine.packing import PackedBatch
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher
from opkd_mcore.losses.teacher_outputs import DenseTeacher


class InStepTeacher:
    """A `MegatronTeacher`'s chunks, used by the student engine inside its step.

    `vocab_size`: ids at or above it get probability 0 in the teacher's logits (the student's
    vocabulary: the loss compares distributions over the ids the student can emit).
    `own_vocabulary`: the teacher's ids are its own tokenizer's (`loss.cross_tokenizer`):
    `vocab_size` is then the teacher's vocabulary, kept whatever the student's.
    """

    def __init__(self, teacher, *, vocab_size: int, own_vocabulary: bool = False):
        self.teacher = teacher  # opkd_mcore.teacher.megatron_teacher.MegatronTeacher
        self.chunks = teacher.engine.model
        self.vocab_size = vocab_size
        self.own_vocabulary = own_vocabulary
        self.hidden_size = self.chunks[0].config.hidden_size
        self.name = teacher.address

    def num_parameters(self) -> int:
        """Elements of the teacher's weights on this rank (its shard only)."""
        return sum(p.numel() for chunk in self.chunks for p in chunk.parameters())

    def acquire(self) -> None:
        """Weights on the device for a step (they may have been offloaded to host memory)."""
        if self.teacher.offloaded:
            self.teacher.reload()

    def release(self) -> None:
        """Weights back to host memory after a step when the teacher is configured to offload."""
        if self.teacher.cfg.offload_between_calls:
            self.teacher.offload()


class PairedChunk(torch.nn.Module):
    """One student chunk (DDP-wrapped) and the teacher chunk of the same pipeline position.

    Megatron's schedule sees this module: `config` is the student's with the hidden size of the
    concatenated p2p tensor, `set_input_tensor` splits what the previous stage sent, and
    `module` points at the student for everything else Megatron looks up (`model_type`, layers).
    """

    def __init__(self, student, teacher, config, student_hidden: int, teacher_hidden: int,
                 pipelined: bool):
        super().__init__()
        self.module = student
        self.teacher = [teacher]  # a list: keeps the teacher out of this module's parameters
        self.student_hidden, self.teacher_hidden = student_hidden, teacher_hidden
        self.pipelined = pipelined
        if pipelined:
            config = copy.copy(config)
            config.hidden_size = student_hidden + teacher_hidden
        self.config = config
        self.post_process = _unwrap(student).post_process
        # the teacher's own packing, (tokens [1, M], position_ids [1, M], packed_seq_params), set per
        # micro-batch by the engine; None: the teacher reads the student's tokens
        self.teacher_input = None

    def set_input_tensor(self, input_tensor) -> None:
        tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        if tensor is None:  # first stage: the models embed the tokens themselves
            _unwrap(self.module).set_input_tensor(None)
            self.teacher[0].set_input_tensor(None)
            return
        student, teacher = tensor.split([self.student_hidden, self.teacher_hidden], dim=-1)
        _unwrap(self.module).set_input_tensor(student.contiguous())
        teacher_dtype = self.teacher[0].config.params_dtype
        self.teacher[0].set_input_tensor(teacher.detach().to(teacher_dtype).contiguous())

    def forward(self, *args, **kwargs):
        """Last stage: (student logits, teacher logits); other stages: the concatenated hidden."""
        student_out = self.module(*args, **kwargs)
        with torch.no_grad():
            if self.teacher_input is None:
                teacher_out = self.teacher[0](*args, **kwargs)
            else:
                tokens, positions, params = self.teacher_input
                teacher_out = self.teacher[0](tokens, positions, attention_mask=None,
                                              packed_seq_params=params)
        if self.post_process:
            return student_out, teacher_out
        return torch.cat([student_out, teacher_out.to(student_out.dtype)], dim=-1)


def _unwrap(module):
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def teacher_packing(batch: PackedBatch) -> PackedBatch | None:
    """The teacher-side sequences of a micro-batch whose teacher has its own tokens, packed as the
    model reads them; None when the teacher reads the student's tokens."""
    teacher = batch.teacher
    if not isinstance(teacher, CrossTokenizerTeacher):
        return None
    cu = teacher.cu_seqlens
    lengths = (cu[1:] - cu[:-1]).long()
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)
    positions = torch.arange(teacher.tokens.numel(), dtype=torch.int64) - starts
    return PackedBatch(tokens=teacher.tokens, position_ids=positions, cu_seqlens=cu,
                       loss_mask=torch.zeros(teacher.tokens.numel(), dtype=torch.float32))


def with_teacher_logits(teacher: CrossTokenizerTeacher, logits_local: torch.Tensor) -> CrossTokenizerTeacher:
    """The cross-tokenizer teacher with the step's dense rows `[M, V_local]` filled in."""
    return dataclasses.replace(teacher, rows=DenseTeacher(logits_local))


def paired_chunks(student_chunks: list, teacher: InStepTeacher, config) -> list[PairedChunk]:
    """Pair each student chunk with the teacher chunk at the same pipeline position."""
    if len(student_chunks) != len(teacher.chunks):
        raise ValueError(f"teacher: {len(teacher.chunks)} model chunks on this rank, the student has "
                         f"{len(student_chunks)} (the teacher must use the same PP/VPP layout)")
    pipelined = config.pipeline_model_parallel_size > 1
    return [PairedChunk(s, t, config, config.hidden_size, teacher.hidden_size, pipelined)
            for s, t in zip(student_chunks, teacher.chunks)]


def unpair(model: list) -> list:
    """The student chunks inside `paired_chunks` (identity for plain chunks)."""
    return [m.module if isinstance(m, PairedChunk) else m for m in model]
