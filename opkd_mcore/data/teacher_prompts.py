"""The teacher's own prompt per record (privileged context), checked and tokenised like the student's.

A run may give the teacher a prompt of its own for every record: the reference solution, feedback
on an earlier attempt, a demonstration. It comes from a field of the record
(`data.teacher_prompt_key`: a text, or chat messages) or from a template over the record's fields
(`data.teacher_prompt_template`, `str.format` style: `"{prompt}\\nA correct solution: {solution}\\n"`;
`{prompt}` is the record's text prompt also when the record holds chat messages). The student
generates from its own prompt; the teacher scores the same response tokens after its prompt
(`engine/response_pairing.py` pairs the rows).

The chat template is applied as for the student (`data.build.encode_record`): chat messages go
through it; a text teacher prompt of a chat record takes the place of the record's last user
message (system turns and earlier turns kept); a text prompt of a text record is raw, or one user
turn with `data.chat_template: always`.

A record without the field (or with a null in it) has no teacher prompt: `data.missing_teacher_prompt:
error` names each such record by file, line and field; `skip` leaves it out before sampling, as
`data.overlong: skip` does.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from opkd_mcore.config.checks import format_fields
from opkd_mcore.config.schema import DataSection
from opkd_mcore.data.build import encode_chat, encode_prompt
from opkd_mcore.data.prompts import PromptDataset
from opkd_mcore.data.records import DataError, describe, message_problems


@dataclass(frozen=True)
class TeacherPrompts:
    """Where a run's teacher prompts come from: one record field, or a template (exactly one set)."""

    key: str | None = None
    template: str | None = None

    @classmethod
    def from_config(cls, data: DataSection) -> "TeacherPrompts | None":
        """The `data` section's teacher prompts, or None when the teacher scores the student's prompt."""
        if data.teacher_prompt_key is None and data.teacher_prompt_template is None:
            return None
        return cls(key=data.teacher_prompt_key, template=data.teacher_prompt_template)

    def problem(self, dataset: PromptDataset, i: int) -> str | None:
        """What keeps record i from having a teacher prompt (`field "x": ...`), or None."""
        row = dataset.records[i]
        if self.template is not None:
            fields = self._fields(dataset, i)
            missing = [f for f in format_fields(self.template) if fields.get(f) is None]
            if missing:
                return (f'field "{missing[0]}" (of data.teacher_prompt_template): missing'
                        + (f" (also {missing[1:]})" if len(missing) > 1 else ""))
            return None
        value = row.get(self.key)
        if value is None:
            return f'field "{self.key}" (data.teacher_prompt_key): missing'
        if isinstance(value, list):
            found = message_problems(value, self.key)
            return found[0] if found else None
        if not isinstance(value, str):
            return f'field "{self.key}": expected a string or chat messages, got {describe(value)}'
        return None

    def value(self, dataset: PromptDataset, i: int) -> str | list[dict]:
        """Record i's teacher prompt: a text, or chat messages (`problem` must be None)."""
        if self.template is not None:
            return self.template.format_map(self._fields(dataset, i))
        return dataset.records[i][self.key]

    @staticmethod
    def _fields(dataset: PromptDataset, i: int) -> dict:
        row = dataset.records[i]
        return {**row, "prompt": row.get("prompt") if row.get("prompt") is not None else dataset.prompt(i)}


@dataclass(frozen=True)
class MissingTeacherPrompt:
    """A record left without a teacher prompt (`data.missing_teacher_prompt: skip`)."""

    index: int  # its index in the dataset as read
    location: str  # `path:LINE`, `path: record I`, `path: row I`
    problem: str  # what is missing, e.g. `field "solution" (of data.teacher_prompt_template): missing`

    def to_dict(self) -> dict:
        return asdict(self)


def find_missing(dataset: PromptDataset, prompts: TeacherPrompts | None) -> list[MissingTeacherPrompt]:
    """Every record of `dataset` without a usable teacher prompt, in order ([] without teacher prompts)."""
    if prompts is None:
        return []
    out = []
    for i in range(len(dataset)):
        problem = prompts.problem(dataset, i)
        if problem is not None:
            out.append(MissingTeacherPrompt(index=i, location=dataset.location(i), problem=problem))
    return out


def missing_error(missing: list[MissingTeacherPrompt], key: str | None) -> DataError:
    """The error of `data.missing_teacher_prompt: error`: each record by file, line and field."""
    return DataError([f"{m.location}: {m.problem}" for m in missing], key,
                     hint="give every record its teacher prompt, or set data.missing_teacher_prompt: skip "
                          "to leave such records out")


def encode_teacher_prompt(tokenizer, dataset: PromptDataset, index: int, prompts: TeacherPrompts,
                          chat_template: str = "auto") -> list[int]:
    """Token ids of record `index`'s teacher prompt, the chat template applied as for the student."""
    value = prompts.value(dataset, index)
    source = f"{dataset.location(index)}: teacher prompt"
    student_messages = dataset.messages(index)
    if isinstance(value, list) or (student_messages is not None and chat_template != "none"):
        if chat_template == "none":
            raise ValueError(f"{source}: chat messages, but data.chat_template is 'none'; give a text "
                             "teacher prompt or use 'auto'")
        messages = value if isinstance(value, list) else _replace_last_user(student_messages, value)
        return encode_chat(tokenizer, messages, source=source)
    if chat_template == "always":
        return encode_chat(tokenizer, [{"role": "user", "content": value}], source=source)
    return encode_prompt(tokenizer, value)


def _replace_last_user(messages: list[dict], text: str) -> list[dict]:
    last = max(j for j, m in enumerate(messages) if m["role"] == "user")
    return [*messages[:last], {**messages[last], "content": text}, *messages[last + 1:]]
