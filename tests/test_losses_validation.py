"""Every bad input of the kd_loss contract raises ValueError whose message starts with the argument."""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss

N, V, K = 4, 11, 3


def good_inputs():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(N, V, generator=gen)
    teacher = torch.randn(N, V, generator=gen)
    ids = torch.tensor([[0, 5, 10], [1, 2, -1], [-1, -1, -1], [7, 3, 9]])
    logprobs = torch.where(ids >= 0, torch.log_softmax(teacher, -1).gather(1, ids.clamp(min=0)),
                           torch.tensor(float("-inf")))
    return student, teacher, ids, logprobs


def bad_cases():
    student, teacher, ids, logprobs = good_inputs()
    topk = TopKTeacher(ids, logprobs)
    dense = DenseTeacher(teacher)
    nan_logits = teacher.clone()
    nan_logits[2, 3] = float("nan")
    nan_logprobs = logprobs.clone()
    nan_logprobs[3, 1] = float("nan")
    too_big, negative, dup = ids.clone(), ids.clone(), ids.clone()
    too_big[3, 2] = V
    negative[0, 1] = -2
    dup[3, 2] = 7
    on_topk = dict(support="teacher")
    return {
        "student 1-D": ("student_logits", student[0], dense, {}),
        "student int": ("student_logits", student.long(), topk, dict(support="teacher")),
        "dense shape": ("teacher.logits", student, DenseTeacher(teacher[:, :-1]), {}),
        "dense rows": ("teacher.logits", student, DenseTeacher(teacher[:-1]), {}),
        "topk ids rows": ("teacher.ids", student, TopKTeacher(ids[:-1], logprobs[:-1]), on_topk),
        "topk ids float": ("teacher.ids", student, TopKTeacher(ids.float(), logprobs), on_topk),
        "topk logprobs shape": ("teacher.logprobs", student, TopKTeacher(ids, logprobs[:, :-1]),
                                dict(support="teacher")),
        "id >= V": ("teacher.ids", student, TopKTeacher(too_big, logprobs), dict(support="teacher")),
        "id < -1": ("teacher.ids", student, TopKTeacher(negative, logprobs), dict(support="teacher")),
        "duplicate ids": ("teacher.ids", student, TopKTeacher(dup, logprobs), dict(support="teacher")),
        "NaN dense teacher": ("teacher.logits", student, DenseTeacher(nan_logits), {}),
        "NaN top-k logprobs": ("teacher.logprobs", student, TopKTeacher(ids, nan_logprobs), on_topk),
        "raw + reverse": ("mass", student, topk, dict(on_topk, mass="raw", divergence="reverse_kl")),
        "raw + jsd": ("mass", student, dense, dict(support="teacher", k=2, mass="raw", divergence="jsd")),
        "union + top-k": ("support", student, topk, dict(support="union")),
        "None + top-k": ("support", student, topk, {}),
        "unknown support": ("support", student, dense, dict(support="student", k=2)),
        "unknown divergence": ("divergence", student, dense, dict(divergence="kl")),
        "unknown mass": ("mass", student, topk, dict(support="teacher", mass="full")),
        "beta > 1": ("beta", student, dense, dict(divergence="jsd", beta=1.5)),
        "temperature 0": ("temperature", student, dense, dict(temperature=0.0)),
        "temperature nan": ("temperature", student, dense, dict(temperature=float("nan"))),
        "negative coverage": ("coverage_coef", student, topk, dict(support="teacher", coverage_coef=-1.0)),
        "dense support without k": ("k", student, dense, dict(support="teacher")),
        "k > V": ("k", student, dense, dict(support="union", k=V + 1)),
        "k > K": ("k", student, topk, dict(support="teacher", k=K + 1)),
        "k = 0": ("k", student, dense, dict(support="teacher", k=0)),
        "bad impl": ("impl", student, dense, dict(impl="cuda")),
        "teacher type": ("teacher", student, teacher, {}),
    }


@pytest.mark.parametrize("name", list(bad_cases()))
def test_bad_input_names_the_argument(name):
    argument, student, teacher, kwargs = bad_cases()[name]
    with pytest.raises(ValueError, match=f"^{argument.replace('.', '[.]')}:") as err:
        kd_loss(student, teacher, **kwargs)
    assert "expected" in str(err.value)  # and says what was expected


def test_content_checks_are_skipped_with_validate_false():
    student, _, ids, logprobs = good_inputs()
    dup = ids.clone()
    dup[3, 2] = 7
    with pytest.raises(ValueError, match="^teacher.ids: expected distinct ids"):
        kd_loss(student, TopKTeacher(dup, logprobs), support="teacher")
    assert kd_loss(student, TopKTeacher(dup, logprobs), support="teacher", validate=False).shape == (N,)
    with pytest.raises(ValueError, match="^mass"):  # option checks stay on
        kd_loss(student, TopKTeacher(ids, logprobs), support="teacher", mass="raw", divergence="jsd",
                validate=False)


def test_padding_written_as_id_zero_is_not_padding():
    """The peer trap: id 0 with logprob 0 means probability 1 on token 0, and duplicates are caught."""
    student, _, ids, logprobs = good_inputs()
    bad_pad = torch.where(ids >= 0, ids, 0)
    with pytest.raises(ValueError, match="^teacher.ids: expected distinct ids"):
        kd_loss(student, TopKTeacher(bad_pad, torch.where(ids >= 0, logprobs, 0.0)), support="teacher")
