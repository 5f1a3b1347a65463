"""Student and teacher tokens of one response, aligned by character spans (`loss.cross_tokenizer`).

The student's response ids are decoded into text, the text is tokenized again with the teacher's
tokenizer, and the two token sequences are cut into the smallest spans that start and end at the
same character in both (`align_ends`). A span of one token on each side is a 1:1 span; the loss
compares the two distributions there directly when the two tokens are the same string
(`VocabMap`), and compares span distributions elsewhere (losses/cross_tokenizer.py).

Character offsets:

* the teacher's tokens: the fast tokenizer's `return_offsets_mapping`; only each token's end is
  used (a token covers the characters after the previous token's end), so characters a tokenizer
  drops (a pre-tokenizer that removes whitespace) belong to the next token, and a token's end is
  made at least its predecessor's;
* the student's generated ids: incremental decoding (as vLLM detokenizes a stream): token i's text
  is `decode(window + ids[..i])` minus `decode(window + ids[..i-1])`, the window being the last
  few tokens already decoded (and the prompt's last tokens before the first response token, so a
  leading space decodes as it reads in context). A byte-level BPE piece that ends inside a
  multi-byte UTF-8 character decodes to U+FFFD; it is held back until a later token completes the
  character, and every held-back token gets the end of the token that completes it. They then
  always fall into one span with it: no span boundary exists inside a character. Pieces still
  incomplete at the end of the response are flushed with what the tokenizer decodes (U+FFFD).

Special tokens of the student's response (its tokenizer's `all_special_ids`):

* the one the response ends with (the end of turn: `<eos>`, `<|im_end|>`, `<|eot_id|>`; whatever
  stopped the rollout) is *mapped*: the teacher's sequence ends with the teacher's `eos_token`,
  and the two form a 1:1 span of their own;
* any other special token in the response (a stray `<bos>`, `<pad>`, a template marker sampled
  mid-response) is *dropped*: it adds no text and its row gets no loss.

Tokens a tokenizer adds but does not mark special (Qwen's `<think>`) are text like any other: they
decode to their content and the teacher tokenizes that content (into its own added token of the
same content, if it has one). The teacher's prompt is built by the caller from the same record
with the teacher's tokenizer and chat template; only response tokens are aligned. The response
text is tokenized on its own (`add_special_tokens=False`), as TRL's GOLD trainer does.

When both tokenizers are the same vocabulary (every token string has the same id, the same
special tokens), the teacher scores the student's own ids and every token is its own span: the
loss is then exactly the same-tokenizer loss, whatever tokenization the student sampled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Prompt tokens decoded before the first response token, so that its text reads as in context
# (a leading space a decoder strips at the start of a call); vLLM's detokenizer uses ~5.
DECODE_WINDOW = 6
REPLACEMENT = "\ufffd"


# ---------------------------------------------------------------- character offsets
def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decode_ends(tokenizer, ids: list[int], context: list[int] = ()) -> tuple[str, list[int]]:
    """`(text, ends)` of `ids` decoded after `context` (ids before them, e.g. the prompt's):
    `text` is what `ids` add to the context, `ends[i]` the character where token i's text ends in
    it. Tokens that complete no character (a byte-level piece of a multi-byte character) get the
    end of the token that completes it (module docstring)."""
    ctx = list(context)[-DECODE_WINDOW:]
    seq = ctx + [int(t) for t in ids]
    # tokens before `read` are emitted; decoding starts at `prefix`, a character boundary (as
    # vLLM's detokenizer: a decoder that treats the first token of a call specially sees the
    # same first token in both calls)
    prefix, read = 0, len(ctx)
    before = _decode(tokenizer, seq[prefix:read])
    text, ends = "", []
    for i in range(len(ctx), len(seq)):
        after = _decode(tokenizer, seq[prefix:i + 1])
        if (len(after) > len(before) and not after.endswith(REPLACEMENT)) or i == len(seq) - 1:
            text += after[len(before):] if after.startswith(before) else after[_common(before, after):]
            ends += [len(text)] * (i + 1 - read)
            prefix, read = read, i + 1
            before = _decode(tokenizer, seq[prefix:read])
    return text, ends


def _common(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b` (a decoder that rewrites earlier text)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_ends(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """`(ids, ends)` of `text` tokenized alone (no special tokens added): token i covers the
    characters up to `ends[i]`, ends non-decreasing, the last one `len(text)`."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer: {getattr(tokenizer, 'name_or_path', '?')} is not a fast tokenizer; "
                         "loss.cross_tokenizer aligns by the character offsets only fast tokenizers give")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends, high = [int(t) for t in enc["input_ids"]], [], 0
    for _, end in enc["offset_mapping"]:
        high = max(high, int(end))
        ends.append(high)
    if ends:
        ends[-1] = len(text)   # characters past the last token (dropped whitespace) belong to it
    return ids, ends


# ---------------------------------------------------------------- spans
def align_ends(student_ends: list[int], teacher_ends: list[int]) -> list[tuple[int, int, int, int]]:
    """The smallest spans `(s0, s1, t0, t1)` (student tokens s0..s1-1, teacher tokens t0..t1-1)
    that end at the same character on both sides. Both lists are non-decreasing with the same
    last value; tokens that end where a span ends (zero-width ones) belong to that span. A side
    with no tokens gives one span with nothing on that side."""
    n_s, n_t = len(student_ends), len(teacher_ends)
    if not n_s or not n_t:
        return [(0, n_s, 0, n_t)] if n_s or n_t else []
    if student_ends[-1] != teacher_ends[-1]:
        raise ValueError(f"teacher_ends: expected the same last character as the student's "
                         f"({student_ends[-1]}), got {teacher_ends[-1]}")
    spans, i, j = [], 0, 0
    while i < n_s:
        s0, t0 = i, j
        while student_ends[i] != teacher_ends[j]:
            if student_ends[i] < teacher_ends[j]:
                i += 1
            else:
                j += 1
        end = student_ends[i]
        while i < n_s and student_ends[i] == end:
            i += 1
        while j < n_t and teacher_ends[j] == end:
            j += 1
        spans.append((s0, i, t0, j))
    return spans


@dataclass(frozen=True)
class ResponseAlignment:
    """One response on both sides. Indices count response tokens (0 = the first response token).

    teacher_ids: the teacher's response tokens (the teacher's EOS last when the student's response
        ended with a special token).
    spans: `(student_tokens, teacher_tokens)` per aligned span, in order; each a tuple of indices,
        both non-empty.
    dropped: student response tokens outside every span (special tokens mid-response, text the
        teacher tokenized into nothing): their rows get no loss.
    """

    teacher_ids: list[int]
    spans: list[tuple[tuple[int, ...], tuple[int, ...]]]
    dropped: tuple[int, ...] = ()


class TokenAligner:
    """Aligns student responses with the teacher's tokenization (module docstring); built once."""

    def __init__(self, student_tokenizer, teacher_tokenizer):
        self.student, self.teacher = student_tokenizer, teacher_tokenizer
        self.student_special = set(int(i) for i in student_tokenizer.all_special_ids)
        self.vocab_map = build_vocab_map(student_tokenizer, teacher_tokenizer)
        self.same_tokenizer = self.vocab_map.identical
        self.teacher_eos = teacher_tokenizer.eos_token_id
        if self.teacher_eos is None and not self.same_tokenizer:
            raise ValueError(f"teacher tokenizer: {getattr(teacher_tokenizer, 'name_or_path', '?')} has no "
                             "eos_token; the end of a student response maps to it")

    def align(self, prompt_ids: list[int], response_ids: list[int]) -> ResponseAlignment:
        """The teacher's response tokens and the spans of one student response (after `prompt_ids`)."""
        response = [int(t) for t in response_ids]
        if self.same_tokenizer:  # the teacher scores the student's own tokens, one span each
            return ResponseAlignment(list(response), [((i,), (i,)) for i in range(len(response))])
        ends_with_marker = bool(response) and response[-1] in self.student_special
        body = response[:-1] if ends_with_marker else response
        text_pos = [i for i, t in enumerate(body) if t not in self.student_special]
        context = [int(t) for t in prompt_ids if int(t) not in self.student_special]
        text, student_ends = decode_ends(self.student, [body[i] for i in text_pos], context)
        teacher_ids, teacher_ends = encode_ends(self.teacher, text)
        spans, covered = [], set()
        for s0, s1, t0, t1 in align_ends(student_ends, teacher_ends):
            if s1 > s0 and t1 > t0:
                members = tuple(text_pos[s0:s1])
                spans.append((members, tuple(range(t0, t1))))
                covered.update(members)
        if ends_with_marker:
            spans.append(((len(response) - 1,), (len(teacher_ids),)))
            covered.add(len(response) - 1)
            teacher_ids = teacher_ids + [self.teacher_eos]
        dropped = tuple(i for i in range(len(response)) if i not in covered)
        return ResponseAlignment(teacher_ids, spans, dropped)

    def is_exact(self, student_id: int, teacher_id: int) -> bool:
        """The two tokens are the same string (a 1:1 span compares their distributions directly)."""
        return self.vocab_map.student_of(teacher_id) == student_id


# ---------------------------------------------------------------- vocabularies
@dataclass(frozen=True)
class VocabMap:
    """Teacher ids that are one student token's string, one to one.

    teacher_to_student: `[V_teacher]` int64, the student id of each teacher id, -1 where none.
    identical: both tokenizers have the same vocabulary (same string at every id, same special
        tokens), so the teacher can score the student's own ids.
    """

    teacher_to_student: torch.Tensor
    identical: bool = False

    @property
    def num_mapped(self) -> int:
        return int((self.teacher_to_student >= 0).sum())

    def student_of(self, teacher_id: int) -> int:
        if not 0 <= teacher_id < self.teacher_to_student.numel():
            return -1
        return int(self.teacher_to_student[teacher_id])


# in priority order: a token that is both a tokenizer's EOS and its PAD maps as the EOS
SPECIAL_ROLES = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")


def build_vocab_map(student_tokenizer, teacher_tokenizer) -> VocabMap:
    """The one-to-one map between the two vocabularies by token string.

    Ordinary tokens map when they decode to the same text (decoded after a fixed anchor token, so a
    leading space survives whatever the tokenizer's space marker is: "Ġ", "▁" or " "); a text
    held by two ids of one tokenizer, or containing U+FFFD (a byte piece of a character), maps to
    nothing. Special tokens map by role (EOS to EOS, BOS to BOS, PAD, UNK) and otherwise by
    identical content."""
    identical = (student_tokenizer.get_vocab() == teacher_tokenizer.get_vocab()
                 and _roles(student_tokenizer) == _roles(teacher_tokenizer))
    size_t = len(teacher_tokenizer)
    if identical:
        return VocabMap(torch.arange(size_t, dtype=torch.int64), identical=True)
    mapping = torch.full((size_t,), -1, dtype=torch.int64)
    student_text, teacher_text = _token_texts(student_tokenizer), _token_texts(teacher_tokenizer)
    student_by_text = _unique_inverse(student_text)
    for text, t_id in _unique_inverse(teacher_text).items():
        if text in student_by_text:
            mapping[t_id] = student_by_text[text]
    s_special = _specials(student_tokenizer)
    for content, t_id in _specials(teacher_tokenizer).items():
        if content in s_special:
            mapping[t_id] = s_special[content]
    taken_s, taken_t = set(), set()   # roles in order: a token playing two roles keeps the first
    for role in SPECIAL_ROLES:
        s_id, t_id = getattr(student_tokenizer, role, None), getattr(teacher_tokenizer, role, None)
        if s_id is None or t_id is None or t_id >= size_t or s_id in taken_s or t_id in taken_t:
            continue
        mapping[mapping == s_id] = -1   # a role mapping wins over a content match
        mapping[t_id] = s_id
        taken_s.add(s_id)
        taken_t.add(t_id)
    return VocabMap(mapping)


def _roles(tokenizer) -> tuple:
    return tuple(getattr(tokenizer, role, None) for role in SPECIAL_ROLES)


def _specials(tokenizer) -> dict[str, int]:
    """content -> id of the tokenizer's special tokens."""
    return {tokenizer.convert_ids_to_tokens(int(i)): int(i) for i in tokenizer.all_special_ids}


def _token_texts(tokenizer) -> list[str | None]:
    """The text of every ordinary token (None: special, or not a whole character)."""
    size = len(tokenizer)
    special = set(int(i) for i in tokenizer.all_special_ids)
    anchor_ids = tokenizer("a", add_special_tokens=False)["input_ids"]
    anchor = [int(anchor_ids[0])] if anchor_ids else []
    lead = _decode(tokenizer, anchor)
    decoded = tokenizer.batch_decode([anchor + [i] for i in range(size)], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
    texts = []
    for i, both in enumerate(decoded):
        text = both[len(lead):] if both.startswith(lead) else None
        texts.append(None if i in special or not text or REPLACEMENT in text else text)
    return texts


def _unique_inverse(texts: list[str | None]) -> dict[str, int]:
    """text -> id for the texts held by exactly one id."""
    seen: dict[str, int] = {}
    twice = set()
    for i, text in enumerate(texts):
        if text is None:
            continue
        if text in seen:
            twice.add(text)
        seen[text] = i
    return {text: i for text, i in seen.items() if text not in twice}
