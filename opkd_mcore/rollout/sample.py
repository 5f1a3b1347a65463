"""One generated response, with everything the trainer needs to use it on-policy."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """A prompt and one sampled response.

    `response_logprobs[i]` is the sampler's logprob of `response_ids[i]` (None where the engine was
    not asked for them: nothing in the run reads them); `weight_version` is the
    version of the student weights the whole response was generated with; `group_id` is the index
    of the prompt in its batch (the n samples of one prompt share it).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None
    finish_reason: str
    weight_version: int
    group_id: int
    data: dict = field(default_factory=dict)  # per-prompt fields (data_source, answer, ...)
    # the teacher's own prompt (privileged context, `data/teacher_prompts.py`); None: the student's
    teacher_prompt_ids: list[int] | None = None

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by response: what the student trains on."""
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def teacher_prompt_len(self) -> int:
        return len(self.prompt_ids if self.teacher_prompt_ids is None else self.teacher_prompt_ids)

    @property
    def teacher_sequence(self) -> list[int]:
        """The teacher's prompt followed by the same response: what a teacher scores."""
        prompt = self.prompt_ids if self.teacher_prompt_ids is None else self.teacher_prompt_ids
        return list(prompt) + list(self.response_ids)
