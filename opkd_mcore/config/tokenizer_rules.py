"""Rules of `loss.cross_tokenizer` (a teacher with another tokenizer) that need no device.

Across tokenizers the teacher scores its own tokenization of each response (its prompt built from
the same record with its tokenizer) and the loss compares the two sides span by span
(docs/losses.md, "Across tokenizers"). That fixes what else the run may ask for: the logit form
on the teacher's top-k (mapped to student ids where the tokens map), one teacher whose tokenizer
the trainer can read, and the torchrun launcher.
"""
from __future__ import annotations

from opkd_mcore.config.checks import choice, positive
from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.loss_rules import cross_tokenizer_mode, teacher_output
from opkd_mcore.config.model_checks import load_tokenizer_info
from opkd_mcore.config.schema import CROSS_TOKENIZER_MODES, TrainConfig


def check_cross_tokenizer(cfg: TrainConfig, tokenizers: dict) -> None:
    """`ConfigError` naming the key of the first setting a cross-tokenizer run cannot honour."""
    loss = cfg.loss
    mode = cross_tokenizer_mode(loss.cross_tokenizer)
    choice("loss.cross_tokenizer", mode, CROSS_TOKENIZER_MODES)
    positive("loss.gold_exact_weight", loss.gold_exact_weight, allow_zero=True)
    positive("loss.gold_uld_weight", loss.gold_uld_weight, allow_zero=True)
    if mode == "off":
        return
    why = f"loss.cross_tokenizer: {mode} compares the two models' distributions span by span"
    if loss.form != "logit":
        raise ConfigError(f"loss.form: {loss.form!r} scores the student's sampled token by the teacher's "
                          f"ids; {why} (use loss.form: logit)")
    if loss.support != "teacher":
        raise ConfigError(f"loss.support: {loss.support!r}: {why}, on the teacher's top-k mapped to the "
                          "student's ids; set loss.support: teacher (and loss.k for a dense teacher)")
    if loss.confidence_alpha:
        raise ConfigError("loss.confidence_alpha: teacher-confidence weights read the teacher's logprobs "
                          "of the student's own tokens, which a teacher with another tokenizer does not "
                          "give (use 0)")
    teachers = cfg.teacher.teachers
    if len(teachers) > 1:
        raise ConfigError(f"teacher.teachers: {why} against one teacher's tokenizer; got {len(teachers)} "
                          "teachers (use one, with replica_urls for more servers of it)")
    t = teachers[0]
    if t.backend == "self":
        raise ConfigError(f"teacher.teachers.0.backend: a self teacher is the student, with the student's "
                          f"tokenizer; {why} of two tokenizers (use loss.cross_tokenizer: off)")
    if cfg.data.teacher_prompt_key or cfg.data.teacher_prompt_template:
        key = "teacher_prompt_key" if cfg.data.teacher_prompt_key else "teacher_prompt_template"
        raise ConfigError(f"data.{key}: across tokenizers the teacher's prompt is the record's own prompt "
                          "built with the teacher's tokenizer; teacher prompts of their own are not wired "
                          "there (unset it, or use loss.cross_tokenizer: off)")
    if teacher_output(t) == "hidden":
        raise ConfigError("teacher.teachers.0.output: 'hidden' hands over the teacher's hidden states for "
                          f"the fused LM head; {why} (use output: topk)")
    if teacher_output(t) == "dense" and loss.k is None:
        raise ConfigError(f"loss.k: {why} on the dense teacher's top-k; set its width")
    if cfg.controller.kind != "torchrun":
        raise ConfigError(f"controller.kind: {cfg.controller.kind!r}: {why}, which the torchrun launcher "
                          "wires (use controller.kind: torchrun)")
    if t.backend == "remote":
        if not t.model:
            raise ConfigError("teacher.teachers.0.model: a remote teacher with loss.cross_tokenizer needs a "
                              "directory holding its tokenizer (the trainer re-tokenizes each response)")
        if load_tokenizer_info("teacher.teachers.0.model", t.model, tokenizers) is None:
            raise ConfigError(f"teacher.teachers.0.model: no tokenizer files in {t.model!r} (loss."
                              "cross_tokenizer re-tokenizes each response with the teacher's tokenizer)")
