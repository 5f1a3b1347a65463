"""Alignment of a student response with the teacher's tokenization, on tokenizers that disagree on
digits (pairs vs characters), whitespace (a space glued to the next word, or stripped at the start
of a decode) and special tokens (other names and ids). References are computed here by brute
force: the text of every prefix of the response, decoded whole."""
from __future__ import annotations

import random

import pytest

from opkd_mcore.data.token_alignment import (
    REPLACEMENT,
    TokenAligner,
    align_ends,
    build_vocab_map,
    decode_ends,
    encode_ends,
)
from tests._tokenizers import (
    CHARS,
    byte_bpe_tokenizer,
    char_tokenizer,
    digit_pair_tokenizer,
    ids,
    metaspace_tokenizer,
)

TOKENIZERS = {"char": char_tokenizer, "digit_pair": digit_pair_tokenizer, "byte_bpe": byte_bpe_tokenizer,
              "metaspace": metaspace_tokenizer}


def _prefix_ends(tokenizer, token_ids):
    """Brute force: token i ends where decode(ids[:i+1]) ends, once that text is whole characters
    (a prefix ending in U+FFFD takes the end of the first later prefix that is whole)."""
    ends = []
    for i in range(len(token_ids)):
        ends.append(None)
        text = tokenizer.decode(token_ids[:i + 1], clean_up_tokenization_spaces=False)
        if not text.endswith(REPLACEMENT):
            ends = [len(text) if e is None else e for e in ends]
    return [len(tokenizer.decode(token_ids)) if e is None else e for e in ends]


def _random_text(rng, length):
    return "".join(rng.choice(CHARS) for _ in range(length)).strip() or "1"


@pytest.mark.parametrize("name", ["char", "digit_pair", "byte_bpe"])
def test_decode_ends_match_whole_prefix_decoding(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    for _ in range(30):
        token_ids = ids(tok, _random_text(rng, rng.randint(1, 25)))
        text, ends = decode_ends(tok, token_ids)
        assert text == tok.decode(token_ids)
        assert ends == _prefix_ends(tok, token_ids)


def test_byte_pieces_of_one_character_share_its_end():
    tok = byte_bpe_tokenizer()
    token_ids = ids(tok, "ab é→ 12")
    pieces = tok.convert_ids_to_tokens(token_ids)
    assert pieces == ["ab", "Ġ", "Ã", "©", "â", "Ĩ", "Ĵ", "Ġ", "12"]  # é is 2 bytes, → is 3
    text, ends = decode_ends(tok, token_ids)
    assert text == "ab é→ 12"
    assert ends == [2, 3, 4, 4, 5, 5, 5, 6, 8]


def test_leading_space_decodes_in_context():
    """A SentencePiece decoder strips the space at the start of a call: the response's first word
    keeps its space when the prompt's last tokens come first."""
    tok = metaspace_tokenizer()
    prompt, response = ids(tok, "ab"), ids(tok, " ab 12")
    assert tok.decode(response) == "ab 12"
    assert decode_ends(tok, response, prompt) == (" ab 12", [3, 6])


def test_encode_ends_give_dropped_characters_to_the_next_token():
    tok = byte_bpe_tokenizer()
    token_ids, ends = encode_ends(tok, "12 + 34")
    assert tok.convert_ids_to_tokens(token_ids) == ["12", "Ġ+", "Ġ34"]
    assert ends == [2, 4, 7]
    dropping = _whitespace_dropping()   # its pre-tokenizer removes spaces: no token covers them
    token_ids, ends = encode_ends(dropping, "12 + 3 ")
    assert dropping.convert_ids_to_tokens(token_ids) == ["12", "+", "3"]
    assert ends == [2, 4, 7]   # the spaces go to the token after them, the trailing one to the last


def _whitespace_dropping():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "12": 1, "+": 2, "3": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


@pytest.mark.parametrize("student_ends, teacher_ends, spans", [
    ([1, 2, 3], [2, 3], [(0, 2, 0, 1), (2, 3, 1, 2)]),                 # "2" "5" "0" vs "25" "0"
    ([2, 4], [1, 2, 3, 4], [(0, 1, 0, 2), (1, 2, 2, 4)]),
    ([1, 3, 4], [2, 4], [(0, 3, 0, 2)]),                               # no common boundary inside
    ([2, 2, 3], [1, 3], [(0, 3, 0, 2)]),                               # a zero-width student token
    ([0, 2], [2], [(0, 2, 0, 1)]),                                     # a token with no text first
    ([3, 3, 3], [3], [(0, 3, 0, 1)]),                                  # byte pieces of one character
    ([1], [], [(0, 1, 0, 0)]),
])
def test_align_ends(student_ends, teacher_ends, spans):
    assert align_ends(student_ends, teacher_ends) == spans


@pytest.mark.parametrize("student, teacher", [("char", "digit_pair"), ("char", "byte_bpe"),
                                              ("byte_bpe", "char"), ("digit_pair", "metaspace"),
                                              ("metaspace", "byte_bpe")])
def test_spans_hold_the_same_text_on_both_sides(student, teacher):
    """Every span is the smallest one: the same characters on both sides, and no shared boundary
    inside it."""
    s_tok, t_tok = TOKENIZERS[student](), TOKENIZERS[teacher]()
    aligner = TokenAligner(s_tok, t_tok)
    rng = random.Random(1)
    for _ in range(25):
        response = ids(s_tok, _random_text(rng, rng.randint(1, 20)))
        al = aligner.align([], response)
        text, s_ends = decode_ends(s_tok, response)
        t_ids, t_ends = encode_ends(t_tok, text)
        assert al.teacher_ids == t_ids and not al.dropped
        assert [i for span, _ in al.spans for i in span] == list(range(len(response)))
        assert [j for _, span in al.spans for j in span] == list(range(len(t_ids)))
        start = 0
        for s_span, t_span in al.spans:
            end = s_ends[s_span[-1]]
            assert end == t_ends[t_span[-1]] > start
            inner_s = {s_ends[i] for i in s_span[:-1]} - {end}
            inner_t = {t_ends[j] for j in t_span[:-1]} - {end}
            assert not inner_s & inner_t, (s_span, t_span)
            start = end


def test_digit_pairs_and_end_of_turn():
    """char student "250<eos>" against a teacher that writes digit pairs as one token: the first
    two digits form one span, the last digit and the end of turn are 1:1 and map."""
    s_tok, t_tok = char_tokenizer(), digit_pair_tokenizer()
    aligner = TokenAligner(s_tok, t_tok)
    response = ids(s_tok, "250") + [s_tok.eos_token_id]
    al = aligner.align(ids(s_tok, "07+45="), response)
    assert t_tok.convert_ids_to_tokens(al.teacher_ids) == ["25", "0", "<|endoftext|>"]
    assert al.spans == [((0, 1), (0,)), ((2,), (1,)), ((3,), (2,))]
    exact = [aligner.is_exact(response[s[0]], al.teacher_ids[t[0]])
             for s, t in al.spans if len(s) == len(t) == 1]
    assert exact == [True, True]


def test_whitespace_glued_to_the_next_word():
    s_tok, t_tok = char_tokenizer(), byte_bpe_tokenizer()
    response = ids(s_tok, "12 + 3")
    al = TokenAligner(s_tok, t_tok).align([], response)
    assert t_tok.convert_ids_to_tokens(al.teacher_ids) == ["12", "Ġ+", "Ġ", "3"]
    assert al.spans == [((0, 1), (0,)), ((2, 3), (1,)), ((4,), (2,)), ((5,), (3,))]


def test_special_tokens_mid_response_are_dropped_and_the_last_one_is_mapped():
    s_tok, t_tok = char_tokenizer(), byte_bpe_tokenizer()
    response = ids(s_tok, "12") + [s_tok.bos_token_id] + ids(s_tok, "3") + [s_tok.pad_token_id]
    al = TokenAligner(s_tok, t_tok).align([], response)
    # "<bos>" mid-response adds no text: the teacher reads "123"; the final "<pad>" ends the turn
    assert t_tok.convert_ids_to_tokens(al.teacher_ids) == ["12", "3", "<|im_end|>"]
    assert al.dropped == (2,)
    assert al.spans == [((0, 1), (0,)), ((3,), (1,)), ((4,), (2,))]


def test_same_vocabulary_scores_the_students_own_tokens():
    tok = metaspace_tokenizer()
    response = [tok.convert_tokens_to_ids(t) for t in ("▁", "1", "2")]   # not how it would tokenize " 12"
    al = TokenAligner(tok, metaspace_tokenizer()).align([], response)
    assert al.teacher_ids == response and al.spans == [((0,), (0,)), ((1,), (1,)), ((2,), (2,))]


def test_vocab_map_by_text_and_by_role():
    s_tok, t_tok = char_tokenizer(), byte_bpe_tokenizer()
    vmap = build_vocab_map(s_tok, t_tok)
    assert not vmap.identical
    s_vocab, t_vocab = s_tok.get_vocab(), t_tok.get_vocab()
    assert vmap.student_of(t_vocab["Ġ"]) == s_vocab[" "]          # a space, whatever marks it
    assert vmap.student_of(t_vocab["1"]) == s_vocab["1"]
    assert vmap.student_of(t_vocab["12"]) == -1                  # two characters: no student token
    assert vmap.student_of(t_vocab["Ã"]) == -1                   # a byte of "é", not a character
    assert vmap.student_of(t_tok.eos_token_id) == s_tok.eos_token_id
    assert vmap.student_of(t_tok.bos_token_id) == s_tok.bos_token_id
    mapped = vmap.teacher_to_student[vmap.teacher_to_student >= 0]
    assert mapped.unique().numel() == mapped.numel()             # one to one
    pair = build_vocab_map(s_tok, digit_pair_tokenizer())
    digits = digit_pair_tokenizer().get_vocab()
    assert [pair.student_of(digits[d]) for d in "09"] == [s_vocab["0"], s_vocab["9"]]
    assert pair.student_of(digits["25"]) == -1
    assert build_vocab_map(s_tok, char_tokenizer()).identical


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False
        name_or_path = "slow-one"

    with pytest.raises(ValueError, match="slow-one.*fast tokenizer"):
        encode_ends(Slow(), "12")
