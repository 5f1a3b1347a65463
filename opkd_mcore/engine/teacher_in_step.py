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

A teacher on its own tokens. Two features give the teacher other tokens than the student's:
teacher prompts (privileged context, `data/teacher_prompts.py`; a self teacher, `engine/self_teacher.py`:
teacher prompt + the same response) and another tokenizer (`loss.cross_tokenizer`: the teacher's
prompt + the response re-tokenized). Both use one mechanism:

* the micro-batch carries the teacher's packing in one field, `PackedBatch.teacher_tokens` (tokens,
  positions, cu_seqlens of the teacher-side sequences, in the student's order), built by the stages;
* `pad_for_pipeline` pads it with the student's input to the step's one length, so the two hidden
  states still travel as one p2p tensor (the only place either is padded);
* the engine hands it to `PairedChunk.forward` as `teacher_input` (a keyword per call, no state on
  the module), which runs the teacher chunk on it; the last stage then returns the teacher's
  final-norm hidden states `[M, H]`, not logits;
* the engine pairs those rows with the student's before the output layer: by response position
  (`PackedBatch.teacher_index`, `engine/response_pairing.py`: `[T, H]` rows are gathered, never
  `[T, V]` logits), or, across tokenizers, not at all: the span loss reads the teacher's rows in the
  teacher's own layout (`CrossTokenizerTeacher.index`), so all M rows go through the output layer,
  over the teacher's own vocabulary (`InStepTeacher.own_vocabulary`).

Each choice is the simpler of two that work: one packing field on the micro-batch rather than the
teacher-side tokens inside the cross-tokenizer rows (both features need it, and the padding then
happens in one function); a keyword rather than an attribute set on the chunk before each call
(nothing to reset between micro-batches); hidden states then the output layer's GEMM rather than the
model's own logits (the gather before the output layer is what keeps teacher prompts at `[T, H]`,
and the cross-tokenizer case is the same path without the gather).
"""
from __future__ import annotations

import contextlib
import copy

import torch

from opkd_mcore.engine.lm_head import hidden_output


class InStepTeacher:
    """A `MegatronTeacher`'s chunks, used by the student engine inside its step.

    `vocab_size`: ids at or above it get probability 0 in the teacher's logits (the student's
    vocabulary: the loss compares distributions over the ids the student can emit).
    `own_vocabulary`: the teacher's ids are its own tokenizer's (`loss.cross_tokenizer`):
    `vocab_size` is then the teacher's vocabulary, kept whatever the student's.
    """

    stateful = False  # whether run checkpoints keep its weights (`save_state` / `load_state`)

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

    def after_update(self, student_chunks: list) -> None:
        """Called by the engine after each applied optimizer step; a frozen teacher does nothing."""


class PairedChunk(torch.nn.Module):
    """One student chunk (DDP-wrapped) and the teacher chunk of the same pipeline position.

    Megatron's schedule sees this module: `config` is the student's with the hidden size of the
    concatenated p2p tensor, `set_input_tensor` splits what the previous stage sent, and
    `module` points at the student for everything else Megatron looks up (`model_type`, layers).
    The teacher chunk may be the student's own module (a self teacher with the current weights):
    each forward then sets its own input tensor right before it runs, and the teacher's forward runs
    in eval mode (no dropout) without building a graph.
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
        self._inputs = (None, None)  # (student, teacher) halves of what the previous stage sent

    def set_input_tensor(self, input_tensor) -> None:
        tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        if tensor is None:  # first stage: the models embed the tokens themselves
            self._inputs = (None, None)
            return
        student, teacher = tensor.split([self.student_hidden, self.teacher_hidden], dim=-1)
        teacher_dtype = self.teacher[0].config.params_dtype
        self._inputs = (student.contiguous(), teacher.detach().to(teacher_dtype).contiguous())

    def forward(self, *args, teacher_input=None, **kwargs):
        """Last stage: (student logits, teacher output); other stages: the concatenated hidden.

        `teacher_input`: (tokens, position ids, packed_seq_params) of the teacher's own packing of the
        micro-batch (`PackedBatch.teacher_tokens`); its last stage then returns final-norm hidden
        states, which the engine pairs with the student's rows (see the module docstring)."""
        _unwrap(self.module).set_input_tensor(self._inputs[0])
        student_out = self.module(*args, **kwargs)
        teacher = self.teacher[0]
        teacher.set_input_tensor(self._inputs[1])
        with torch.no_grad(), _evaluating(teacher):
            if teacher_input is None:
                teacher_out = teacher(*args, **kwargs)
            else:
                tokens, positions, packed = teacher_input
                with hidden_output(teacher) if self.post_process else contextlib.nullcontext():
                    teacher_out = teacher(tokens, positions, attention_mask=None, packed_seq_params=packed)
        if self.post_process:
            return student_out, teacher_out
        return torch.cat([student_out, teacher_out.to(student_out.dtype)], dim=-1)


@contextlib.contextmanager
def _evaluating(module):
    """`module` (and every submodule) in eval mode inside the block, each restored after."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _unwrap(module):
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


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
