"""The student as its own in-step teacher (`teacher.teachers.N.backend: self`, dense output).

The in-step mechanism (`engine/teacher_in_step.py`) pairs a teacher chunk with every student chunk
and carries both hidden states through the pipeline in one p2p tensor. A self teacher is that
mechanism with the student's own weights, in one of three forms (`weights`):

* `current` -- `CurrentWeightsTeacher`: the teacher chunk paired with each student chunk *is* that
  chunk's GPTModel; the teacher's forward is a second, no-grad, eval-mode forward of the same module
  on the teacher's packing (its own prompts). No copy of the weights; no activations kept.
* `initial` -- a frozen copy: a `MegatronTeacher` loaded from the student's checkpoint, exactly
  what `backend: megatron` with the student's directory builds (`train/teacher_setup.py`).
* `ema` -- `EmaTeacher`: such a copy held in float32 (an average of small steps needs the bits), made
  after each applied optimizer step `ema = decay * ema + (1 - decay) * student`, parameter by
  parameter on this rank's shard (so sharded exactly like the student, TP, PP and VPP alike);
  optionally in host memory between steps (`offload`), and saved in run checkpoints as a Megatron
  dist checkpoint of its own (`save_state` / `load_state`), which `opkd convert` turns into HF.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from opkd_mcore.engine.lm_head import gpt_model
from opkd_mcore.engine.teacher_in_step import InStepTeacher
from opkd_mcore.models.convert import load_mcore_model, save_mcore_checkpoint

logger = logging.getLogger(__name__)


class CurrentWeightsTeacher(InStepTeacher):
    """The student's own chunks as its in-step teacher (built from the chunks the engine trains)."""

    def __init__(self, student_chunks: list, *, vocab_size: int, name: str = "self"):
        self.teacher = None
        self.chunks = [gpt_model(c) for c in student_chunks]
        self.vocab_size = vocab_size
        self.own_vocabulary = False  # the student's tokenizer, by definition
        self.hidden_size = self.chunks[0].config.hidden_size
        self.name = f"{name} (the student's current weights)"

    def num_parameters(self) -> int:
        """None of its own: it runs the student's."""
        return 0

    def acquire(self) -> None:
        """The student's weights are where the student trains."""

    def release(self) -> None:
        """Nothing to move back."""


class EmaTeacher(InStepTeacher):
    """A copy of the student (a `MegatronTeacher` of its checkpoint, float32) kept as a moving average."""

    stateful = True

    def __init__(self, teacher, *, vocab_size: int, decay: float, name: str = "self"):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: expected a value in (0, 1), got {decay!r}")
        super().__init__(teacher, vocab_size=vocab_size)
        self.decay = decay
        self.num_updates = 0
        self.name = f"{name} (an EMA of the student's weights, decay {decay})"

    @torch.no_grad()
    def after_update(self, student_chunks: list) -> None:
        """`ema = decay * ema + (1 - decay) * student` for every parameter of this rank's shard."""
        self.acquire()
        try:
            for ema, live in paired_parameters(self.chunks, student_chunks):
                ema.lerp_(live.to(ema.dtype), 1.0 - self.decay)
            self.num_updates += 1
        finally:
            self.release()

    def save_state(self, ckpt_dir: str) -> None:
        """Its weights as a Megatron dist checkpoint (collective over every rank)."""
        self.acquire()
        try:
            save_mcore_checkpoint(self.chunks, ckpt_dir, num_steps=self.num_updates)
        finally:
            self.release()
        logger.info("saved the EMA teacher (%d updates) to %s", self.num_updates, ckpt_dir)

    def load_state(self, ckpt_dir: str) -> None:
        """Restore what `save_state` wrote (collective; any TP/PP layout may load it)."""
        self.acquire()
        try:
            load_mcore_model(self.chunks, ckpt_dir)
        finally:
            self.release()


def paired_parameters(teacher_chunks: list,
                      student_chunks: list) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(teacher parameter, student parameter) of the same name in the chunks at the same pipeline
    position; ValueError naming the first parameter whose name or shape differs."""
    if len(teacher_chunks) != len(student_chunks):
        raise ValueError(f"teacher: {len(teacher_chunks)} model chunks on this rank, the student has "
                         f"{len(student_chunks)}")
    for i, (t_chunk, s_chunk) in enumerate(zip(teacher_chunks, student_chunks)):
        t_params = list(t_chunk.named_parameters())
        s_params = list(gpt_model(s_chunk).named_parameters())
        if [n for n, _ in t_params] != [n for n, _ in s_params]:
            raise ValueError(f"teacher chunk {i}: parameters {[n for n, _ in t_params][:3]}... do not match "
                             f"the student's {[n for n, _ in s_params][:3]}...")
        for (name, t), (_, s) in zip(t_params, s_params):
            if t.shape != s.shape:
                raise ValueError(f"teacher chunk {i}: {name} has shape {tuple(t.shape)}, the student's "
                                 f"{tuple(s.shape)} (another layout?)")
            yield t, s
