"""`opkd demo --variant cross_tokenizer`: on-policy distillation from a teacher with another tokenizer.

The teacher is trained on the demo's addition task with its own tokenizer: an operator is glued to
the digit after it ("+4", as a GPT-2 tokenizer glues a space to the next word), other special tokens
(`<s>` before a prompt, `<|endoftext|>` at the end of the turn) and other ids for every character.
The student is the main demo's char-level student (a char-level model trained on the task, its MLPs
cut to a few neurons). The distillation runs with `loss.cross_tokenizer: gold`: each sampled
response is decoded, written again in the teacher's tokens after the teacher's own prompt
("<s> 0 7 +4 5 =" where the student reads "<bos> 0 7 + 4 5 ="), scored by the teacher, and aligned
with the student's tokens by character spans. Answer digits are single characters on both sides,
so a well-formed answer's spans are 1:1 spans of the same token (the exact term, on the teacher's
top-k mapped to the student's ids); a span where the student writes an operator and a digit ("=5")
is one teacher token against two student tokens, compared by ULD.

`--quick` (CI, one-digit addition, 80 training problems) glues "=" alone: a teacher that must learn
ten "+d" tokens from 80 problems memorises them (0% held-out), and "=" never precedes a digit in a
prompt, so its prompts read like the student's, in other ids and special tokens.

A teacher that writes each two-digit operand as one token ("07", "45") was tried first: with the
demo's model size and SFT budget (500 steps) it reached 6% held-out exact match on 2000 training
problems and 9% on 9000, as each of the 100 pair tokens must be decomposed into its digits from data;
the glued operators keep the task learnable in the time the demo has.

Evaluation as in `opkd demo`, each model with its own tokenizer; the held-out KL is over the answer
positions, the teacher's distribution on the ids both vocabularies share (renormalised) against the
student's (`heldout_kl_across`). The steps themselves are `demo.run.run_cross_tokenizer_demo`; this
module holds what is particular to the variant.
"""
from __future__ import annotations

import torch

from opkd_mcore.data import ALPHABET, encode_prompt
from opkd_mcore.data.token_alignment import TokenAligner
from opkd_mcore.demo.evaluate import answer_ids


def glued_operator_tokenizer(operators: str = "+="):
    """The teacher's tokenizer: each of `operators` is glued to the digit after it ("+4", "=2": as a
    GPT-2 tokenizer glues a space to the next word), anything else is one character; `<s>` before
    every text, `<|endoftext|>` the end of turn (and padding); ids unlike the student's (the glued
    tokens first, characters in reverse order)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<s>": 1}
    for op in operators:
        vocab.update({f"{op}{d}": len(vocab) + d for d in range(10)})
    for ch in reversed(ALPHABET):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    glued = "[" + "".join("\\" + op for op in operators) + "]"
    core.pre_tokenizer = pre_tokenizers.Split(Regex(glued + r"\d|[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                        special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@torch.no_grad()
def heldout_kl_across(teacher_dir: str, student_dir: str, records: list[dict]) -> float:
    """Mean per-token KL(P || q) over the answer (+EOS) tokens of the held-out problems, each model
    reading prompt + answer in its own tokens, float64: P the teacher's distribution on the ids that
    map to a student token (`VocabMap`), renormalised, q the student's over its vocabulary; at
    spans of one same token on both sides (every answer token in this demo)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s_tok, t_tok = AutoTokenizer.from_pretrained(student_dir), AutoTokenizer.from_pretrained(teacher_dir)
    aligner = TokenAligner(s_tok, t_tok)
    table = aligner.vocab_map.teacher_to_student
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64).eval()
    total, count = 0.0, 0
    for r in records:
        s_prompt, response = encode_prompt(s_tok, r["prompt"]), answer_ids(s_tok, r["answer"])
        t_prompt = encode_prompt(t_tok, r["prompt"])
        aligned = aligner.align(s_prompt, response)
        log_q = torch.log_softmax(student(torch.tensor([s_prompt + response])).logits[0], -1)
        log_p = torch.log_softmax(teacher(torch.tensor([t_prompt + aligned.teacher_ids])).logits[0], -1)
        for s_span, t_span in aligned.spans:
            if len(s_span) != 1 or len(t_span) != 1:
                continue
            p_row = log_p[len(t_prompt) - 1 + t_span[0], :table.numel()]
            keep = table >= 0
            p = torch.log_softmax(p_row[keep], -1)
            q = log_q[len(s_prompt) - 1 + s_span[0], table[keep]]
            total += float((p.exp() * (p - q)).sum())
            count += 1
    return total / max(count, 1)
