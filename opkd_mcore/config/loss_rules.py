"""The loss path's rules that need no device: what a teacher hands the loss, and which objectives and
teachers the fused LM head takes.

Config validation (`validate.py`) and the run's loss plan (`opkd_mcore.losses.plan`) both ask these
functions, so each rule exists once: validation rejects `loss.fused_lm_head: on` for an objective or
teacher it cannot take before anything starts, and the plan applies the same rule (with what the
device runs) when it decides the loss path at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from opkd_mcore.config.schema import LossSection, TeacherEndpoint

# What the loss receives from the run's teacher: top-k rows, full-vocabulary logits handed over,
# final-norm hidden states (+ the teacher's output weight held by the trainer), or the dense logits
# of a megatron teacher run inside the student's step.
TEACHER_KINDS = ("topk", "dense", "hidden", "in_step")
# kinds that reach the fused LM head as hidden states + an output-weight shard (`HiddenTeacher`)
HIDDEN_STATE_KINDS = ("hidden", "in_step")


def teacher_output(t: TeacherEndpoint) -> str:
    """What teacher `t` hands the loss: "dense" logits or "topk" rows (`auto`: dense for megatron and
    self)."""
    if t.output != "auto":
        return t.output
    return "dense" if t.backend in ("megatron", "self") else "topk"


def runs_in_step(t: TeacherEndpoint) -> bool:
    """Whether teacher `t` runs inside the student's step (`engine/teacher_in_step.py`): a megatron
    teacher, and a self teacher with dense output (the student's own forward on the teacher's prompt)."""
    return t.backend == "megatron" or (t.backend == "self" and teacher_output(t) == "dense")


def teacher_kind(teachers: list[TeacherEndpoint]) -> str:
    """The run's teacher kind (one of `TEACHER_KINDS`). Validation allows one kind per run (an in-step
    teacher alone, no mix of dense and top-k), so the first teacher speaks for all."""
    if any(runs_in_step(t) for t in teachers):
        return "in_step"
    return teacher_output(teachers[0])


def cross_tokenizer_mode(value: str | bool) -> str:
    """`loss.cross_tokenizer` as a string (YAML reads a bare off as False; a bare on names no mode)."""
    return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


def fused_lm_head_mode(value: str | bool) -> str:
    """`loss.fused_lm_head` as "auto" | "on" | "off" (YAML reads a bare on / off as a boolean)."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


@dataclass(frozen=True)
class LmHeadBlocker:
    """Why the fused LM head cannot take a run's objective or teacher, in words both callers print."""

    does: str     # what `fused_lm_head: on` does or needs ("fuses the output layer ...")
    reason: str   # what the run has instead
    fix: str      # what to set

    def config_message(self) -> str:
        return f"loss.fused_lm_head: 'on' {self.does}; {self.reason} ({self.fix})"

    def plan_message(self) -> str:
        return f"loss.fused_lm_head: 'on' cannot run: {self.reason} ({self.fix})"


def lm_head_blocker(loss: LossSection, kind: str, teacher: str = "the teacher") -> LmHeadBlocker | None:
    """The rule of what the fused LM head takes: the logit form, fused kernels, and a teacher that is
    not handed over as full-vocabulary logits (`kind` "dense"; `teacher` names it in the message).
    None when it takes them."""
    if loss.form != "logit":
        return LmHeadBlocker("fuses the output layer into the distillation loss",
                             f"loss.form: {loss.form} scores the sampled token from materialised logits",
                             "use auto or off")
    if loss.impl == "reference":
        return LmHeadBlocker("runs the fused LM-head kernels", "loss.impl: reference materialises the logits",
                             "use loss.impl: auto, or fused_lm_head: off")
    if cross_tokenizer_mode(loss.cross_tokenizer) != "off":
        return LmHeadBlocker("fuses the output layer into the distillation loss",
                             f"loss.cross_tokenizer: {loss.cross_tokenizer} aligns the teacher's rows with "
                             "the student's logits span by span", "use auto or off")
    if kind == "dense":
        return LmHeadBlocker("needs the teacher as top-k rows, an in-step megatron teacher or hidden states",
                             f"{teacher} hands over full-vocabulary logits (output: dense)",
                             "use auto or off")
    return None
