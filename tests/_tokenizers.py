"""Small fast tokenizers that disagree on digits, whitespace and special tokens (built with the
`tokenizers` library; nothing is downloaded), for the cross-tokenizer tests."""
from __future__ import annotations

import functools

from opkd_mcore.models.tiny import make_char_tokenizer

CHARS = "0123456789+= abcdefghijklmnopqrstuvwxyzé→"


@functools.lru_cache(maxsize=None)
def char_tokenizer():
    """One token per character; specials <pad> <bos> <eos> (ids 0..2); <bos> before every text."""
    return make_char_tokenizer(CHARS)


@functools.lru_cache(maxsize=None)
def digit_pair_tokenizer():
    """Two digits are one token ("25"), everything else one character; other specials and ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<s>": 1, "<unk>": 2}
    for a in range(100):
        vocab[f"{a:02d}"] = len(vocab)
    for ch in reversed(CHARS):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d\d|[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", bos_token="<s>",
                                   unk_token="<unk>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=None)
def byte_bpe_tokenizer():
    """GPT-2 style byte-level BPE: a space belongs to the next word ("Ġ12"), a character outside the
    training text is several byte tokens ("→" is three); merges of digits and letters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["12 + 34 = 46 and 250 is 52 reversed; cafe naive ab ba cab"] * 20
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=None)
def metaspace_tokenizer():
    """SentencePiece style: a space is "▁" glued to the next piece, and the decoder strips the
    leading space at the start of a decode call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2}
    for ch in CHARS.replace(" ", "") + "▁":
        vocab.setdefault(ch, len(vocab))
    for word in ("▁12", "▁+", "▁=", "▁ab", "ab", "▁a", "12"):
        vocab.setdefault(word, len(vocab))
    merges = [("1", "2"), ("▁", "12"), ("▁", "+"), ("▁", "="), ("a", "b"), ("▁", "ab"), ("▁", "a")]
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
