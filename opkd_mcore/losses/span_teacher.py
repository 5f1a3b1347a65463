"""What the cross-tokenizer loss receives: the teacher's rows in the teacher's own layout and
vocabulary, and how they pair with the student's rows (`SpanIndex`), for one sample or one packed
micro-batch.

The teacher scores its own token sequence (its prompt, then the student's response re-tokenized
with its tokenizer: `data/token_alignment.py`). Row u of the teacher's rows scores teacher token
u+1, as row t of the student's scores student token t+1. An aligned span is a run of student
response tokens and a run of teacher response tokens with the same text; the rows predicting the
first token of each run hold the span's base distributions, the rows predicting the later tokens
("continuation rows") add the log-probability of their actual token (the span's log-probability,
losses/cross_tokenizer.py).

Shape legend: N student rows, M teacher rows, K teacher top-k width.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from opkd_mcore.losses import vocab_parallel as vp
from opkd_mcore.losses.teacher_outputs import PAD_ID, DenseTeacher, TopKTeacher

NONE = -1


@dataclass(frozen=True)
class SpanIndex:
    """Row pairing of one sample or packed batch (every entry a row of the same batch; -1: none).

    exact_row [N]: on the student row of a 1:1 span whose two tokens are the same string: the
        teacher row scoring the teacher's token there.
    span_row [N]: on the first student row of every span: the teacher row of its first token.
    student_cont [N]: on a continuation row of a span: the span's first student row.
    teacher_cont [M]: on a teacher continuation row: the span's first *student* row.
    teacher_next [M]: the teacher token each teacher row scores (-1: none).
    """

    exact_row: torch.Tensor
    span_row: torch.Tensor
    student_cont: torch.Tensor
    teacher_cont: torch.Tensor
    teacher_next: torch.Tensor

    @property
    def num_student_rows(self) -> int:
        return int(self.exact_row.shape[0])

    @property
    def num_teacher_rows(self) -> int:
        return int(self.teacher_next.shape[0])


@dataclass(frozen=True)
class CrossTokenizerTeacher:
    """Teacher rows on the teacher's own tokens, with their pairing to the student's rows.

    rows: `TopKTeacher` `[M, K]` in teacher ids (a scoring teacher), `DenseTeacher` `[M, V_local]`
        sharded over the teacher's vocabulary (a megatron teacher in the step), or None until the
        step's teacher has run.
    tokens: `[M]` int64, one sample's teacher-side sequence (what the teacher scores, and what an
        in-step teacher runs on: the stages pack the samples' sequences into the micro-batch's
        `teacher_tokens`, engine/teacher_in_step.py); None in a packed micro-batch's teacher.
    teacher_to_student: `[V_teacher]` int64, the student id of each teacher id (-1: none), the
        vocabulary map built once for the run (`data.token_alignment.VocabMap`), carried along.
    """

    rows: TopKTeacher | DenseTeacher | None
    index: SpanIndex
    tokens: torch.Tensor | None
    teacher_to_student: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Student rows (a packed batch's `teacher` has one row per student token)."""
        return self.index.num_student_rows


def sample_index(student_len: int, student_prompt: int, teacher_seq: list[int], teacher_prompt: int,
                 spans, exact: list[bool]) -> SpanIndex:
    """The `SpanIndex` of one sample: student sequence of `student_len` tokens whose response starts
    at `student_prompt`, teacher sequence `teacher_seq` whose response starts at `teacher_prompt`;
    `spans[g]` = (student response tokens, teacher response tokens) of span g, `exact[g]` whether
    it is a 1:1 span of the same string. Both sides get one row per token (the last one scores
    nothing), as packing lays them out."""
    m = len(teacher_seq)
    exact_row, span_row, student_cont = (torch.full((student_len,), NONE, dtype=torch.int64)
                                         for _ in range(3))
    teacher_cont = torch.full((m,), NONE, dtype=torch.int64)
    teacher_next = torch.tensor(teacher_seq[1:] + [NONE], dtype=torch.int64)
    for (s_tokens, t_tokens), is_exact in zip(spans, exact):
        first_s = student_prompt - 1 + s_tokens[0]
        first_t = teacher_prompt - 1 + t_tokens[0]
        span_row[first_s] = first_t
        if is_exact:
            exact_row[first_s] = first_t
        for i in s_tokens[1:]:
            student_cont[student_prompt - 1 + i] = first_s
        for j in t_tokens[1:]:
            teacher_cont[teacher_prompt - 1 + j] = first_s
    return SpanIndex(exact_row, span_row, student_cont, teacher_cont, teacher_next)


def concat_cross_teachers(parts: list[CrossTokenizerTeacher]) -> CrossTokenizerTeacher:
    """The samples' teachers of one packed micro-batch, in order: indices shifted to the batch's
    rows, teacher rows concatenated (top-k rows padded to the widest K); the teacher-side tokens
    travel as the micro-batch's `teacher_tokens` packing, not here."""
    s_off = t_off = 0
    fields = {f.name: [] for f in dataclasses.fields(SpanIndex)}
    for part in parts:
        idx = part.index
        for name, off in (("exact_row", t_off), ("span_row", t_off), ("student_cont", s_off),
                          ("teacher_cont", s_off)):
            value = getattr(idx, name)
            fields[name].append(torch.where(value >= 0, value + off, value))
        fields["teacher_next"].append(idx.teacher_next)
        s_off += idx.num_student_rows
        t_off += idx.num_teacher_rows
    index = SpanIndex(**{name: torch.cat(values) for name, values in fields.items()})
    rows = _concat_rows([p.rows for p in parts])
    return CrossTokenizerTeacher(rows, index, None, parts[0].teacher_to_student)


def _concat_rows(rows: list):
    if rows[0] is None:
        return None
    if isinstance(rows[0], DenseTeacher):
        return DenseTeacher(torch.cat([r.logits for r in rows]))
    width = max(r.ids.shape[1] for r in rows)
    pad = [width - r.ids.shape[1] for r in rows]
    ids = [torch.nn.functional.pad(r.ids, (0, p), value=PAD_ID) for r, p in zip(rows, pad)]
    lps = [torch.nn.functional.pad(r.logprobs, (0, p), value=-math.inf) for r, p in zip(rows, pad)]
    return TopKTeacher(torch.cat(ids), torch.cat(lps))


def with_padding_row(rows: TopKTeacher) -> TopKTeacher:
    """A scoring teacher's `L - 1` rows and one padding row for its last token (nothing to score)."""
    k = rows.ids.shape[1]
    return TopKTeacher(torch.cat([rows.ids, torch.full((1, k), PAD_ID, dtype=rows.ids.dtype)]),
                       torch.cat([rows.logprobs, torch.full((1, k), -math.inf, dtype=rows.logprobs.dtype)]))


@torch.no_grad()
def exact_top1_agreement(teacher: CrossTokenizerTeacher, next_tokens_N: torch.Tensor) -> tuple[int, int]:
    """(rows where the teacher's most likely token is the student's next token, rows compared), over
    the exact spans of top-k rows (elsewhere the two vocabularies name no common token)."""
    if not isinstance(teacher.rows, TopKTeacher) or teacher.teacher_to_student is None:
        return 0, 0
    rows = teacher.index.exact_row
    on = rows >= 0
    top1 = teacher.rows.ids[rows.clamp(min=0), 0]
    table = teacher.teacher_to_student
    mapped = torch.where((top1 >= 0) & (top1 < table.numel()), table[top1.clamp(0, table.numel() - 1)], NONE)
    return int(((mapped == next_tokens_N) & on).sum()), int(on.sum())


# ---------------------------------------------------------------- teacher rows as top-k
@torch.no_grad()
def teacher_topk(rows: TopKTeacher | DenseTeacher, next_ids_M: torch.Tensor, *, k: int | None,
                 temperature: float, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(ids [M, K], logprobs [M, K], next_logprob [M])` in teacher ids, float32 (float64 for
    float64 rows).

    Top-k rows are used as given, in their order (temperature does not rescale them, as in
    `kd_loss`); the logprob
    of a row's actual next token that is not among its K is bounded by the row's smallest logprob
    minus log 2 (it is less likely than anything listed; the bound the policy-gradient form uses).
    Dense rows (`[M, V_local]`, the teacher's vocabulary sharded over `group`) give their top-`k` of
    softmax(logits / T) and exact next-token logprobs, vocabulary-parallel."""
    if isinstance(rows, TopKTeacher):
        ids = rows.ids
        lp = rows.logprobs.float() if rows.logprobs.dtype != torch.float64 else rows.logprobs
        valid = ids >= 0
        hit = (ids == next_ids_M[:, None]) & valid
        listed = torch.where(hit, lp, torch.zeros_like(lp)).sum(1)
        floor = torch.where(valid, lp, torch.full_like(lp, math.inf)).amin(1) - math.log(2.0)
        floor = torch.where(valid.any(1), floor, torch.full_like(floor, -math.inf))
        return ids, lp, torch.where(hit.any(1), listed, floor)
    if k is None:
        raise ValueError("k: a dense teacher's rows need the top-k width (loss.k)")
    x = rows.logits if rows.logits.dtype == torch.float64 else rows.logits.float()
    x = x / temperature if temperature != 1.0 else x
    row_max = vp.all_reduce_max_(x.amax(dim=1), group)
    lse = vp.logsumexp_from(row_max, vp.all_reduce_sum_(vp.local_sumexp(x, row_max), group))
    ids = vp.sharded_topk(x, k, group)
    both = torch.cat([ids, next_ids_M[:, None]], dim=1)
    index, on_shard = vp.local_index(both, x.shape[1], vp.shard_offset(x.shape[1], group))
    values = vp.all_reduce_sum_(vp.gather_local(x, index, on_shard), group) - lse[:, None]
    next_lp = torch.where(next_ids_M >= 0, values[:, -1], torch.full_like(values[:, -1], -math.inf))
    return ids, values[:, :-1], next_lp
