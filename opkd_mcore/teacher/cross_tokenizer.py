"""A teacher with another tokenizer, scoring the student's samples (`loss.cross_tokenizer`).

For each sample: the teacher's prompt is built from the same record with the teacher's tokenizer
(its chat template for chat records, exactly as the student's prompt is built with the student's:
`data.encode_chat` / `data.encode_prompt`); the student's response is decoded and re-tokenized with
the teacher's tokenizer and the two are aligned by character spans (`data/token_alignment.py`).
The wrapped teacher scores the teacher-side sequences (top-k rows in the teacher's ids); each
sample's answer is a `CrossTokenizerTeacher`: those rows, one padding row for the last token, and
the span pairing with the student's rows. A teacher that scores inside the student's step (a
megatron teacher) has no wrapped scorer here: the rows stay None and the step fills them from the
teacher's forward on the same teacher-side tokens.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from opkd_mcore.data.build import encode_chat, encode_prompt
from opkd_mcore.data.token_alignment import TokenAligner
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher, sample_index, teacher_topk, with_padding_row
from opkd_mcore.losses.teacher_outputs import DenseTeacher, TopKTeacher
from opkd_mcore.rollout import Sample
from opkd_mcore.teacher.base import SampleScorer


def teacher_prompt_ids(tokenizer, data: Mapping, chat_template: str = "auto") -> list[int]:
    """The teacher's prompt of one record, from its per-prompt data (`messages` for a chat record,
    else the text `prompt`), built as `data.encode_record` builds the student's."""
    messages = data.get("messages")
    if messages is not None:
        return encode_chat(tokenizer, messages, source="teacher prompt")
    if chat_template == "always":
        return encode_chat(tokenizer, [{"role": "user", "content": data["prompt"]}], source="teacher prompt")
    return encode_prompt(tokenizer, data["prompt"])


@dataclass(frozen=True)
class SampleSpans:
    """The aligned spans of one sample and whether each is an exact (1:1, same string) span."""

    spans: list
    exact: list[bool]


class CrossTokenizerScorer(SampleScorer):
    """Scores samples with `teacher` (None: a teacher in the student's step) after re-tokenizing
    them with `teacher_tokenizer`. `max_len`: the longest teacher-side sequence its engine takes.
    A teacher answering with dense logits (an hf teacher, `output: dense`) is cut to its top-`k` of
    softmax(logits / `temperature`) here, before the rows leave this process."""

    def __init__(self, teacher: SampleScorer | None, student_tokenizer, teacher_tokenizer, *,
                 chat_template: str = "auto", max_len: int | None = None, name: str = "teacher",
                 k: int | None = None, temperature: float = 1.0):
        self.teacher, self.name, self.k, self.temperature = teacher, name, k, temperature
        self.teacher_tokenizer, self.chat_template, self.max_len = teacher_tokenizer, chat_template, max_len
        self.aligner = TokenAligner(student_tokenizer, teacher_tokenizer)
        self.teacher_to_student = self.aligner.vocab_map.teacher_to_student

    def score_samples(self, sequences: Sequence[Sequence[int]], data: Sequence[Mapping]):
        raise TypeError("CrossTokenizerScorer scores rollout samples (score_rollout): the alignment needs "
                        "each sample's prompt and response apart")

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()

    def teacher_sequence(self, sample: Sample) -> tuple[list[int], int, SampleSpans]:
        """(teacher-side sequence, its prompt length, the span pairing's inputs) of one sample."""
        prompt = teacher_prompt_ids(self.teacher_tokenizer, sample.data, self.chat_template)
        aligned = self.aligner.align(sample.prompt_ids, sample.response_ids)
        exact = [len(s) == 1 and len(t) == 1
                 and self.aligner.is_exact(sample.response_ids[s[0]], aligned.teacher_ids[t[0]])
                 for s, t in aligned.spans]
        seq = prompt + aligned.teacher_ids
        if self.max_len is not None and len(seq) > self.max_len:
            raise ValueError(f"rollout.max_model_len: teacher {self.name!r} reads this sample as {len(seq)} "
                             f"tokens ({len(prompt)} prompt + {len(aligned.teacher_ids)} response) with its "
                             f"tokenizer, more than its engine's {self.max_len}; raise rollout.max_model_len")
        return seq, len(prompt), SampleSpans(aligned.spans, exact)

    def score_rollout(self, samples: Sequence[Sample]) -> list[CrossTokenizerTeacher]:
        """One `CrossTokenizerTeacher` per sample, `len(sample.sequence)` student rows each."""
        built = [self.teacher_sequence(s) for s in samples]
        rows = [None] * len(samples)
        if self.teacher is not None:
            scored = self.teacher.score_samples([b[0] for b in built], [s.data for s in samples])
            rows = [with_padding_row(self._topk(r, seq)) for r, (seq, _, _) in zip(scored, built)]
        out = []
        for sample, (seq, prompt_len, spans), r in zip(samples, built, rows):
            index = sample_index(len(sample.sequence), len(sample.prompt_ids), seq, prompt_len, spans.spans,
                                 spans.exact)
            out.append(CrossTokenizerTeacher(r, index, torch.tensor(seq, dtype=torch.int64),
                                             self.teacher_to_student))
        return out


    def _topk(self, rows, seq: list[int]) -> TopKTeacher:
        if isinstance(rows, TopKTeacher):
            return rows
        if not isinstance(rows, DenseTeacher):
            raise TypeError(f"teacher {self.name!r}: loss.cross_tokenizer takes top-k rows or dense logits "
                            f"from a scoring teacher, got {type(rows).__name__}")
        ids, logprobs, _ = teacher_topk(rows, torch.tensor(seq[1:]), k=self.k, temperature=self.temperature,
                                        group=None)
        return TopKTeacher(ids, logprobs)
