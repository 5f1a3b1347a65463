"""The loss plan (`opkd_mcore.losses.plan`): every decision of the loss path for each device, dtype,
teacher kind and loss option, against a table written out by hand; an explicit request that cannot
run is refused naming its key; the plan is logged once, in one line; its objective is `kd_loss`'s."""
from __future__ import annotations

import dataclasses
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

from opkd_kernels import cpu_backend
from opkd_kernels.fused_linear_kd import select_linear_engine
from opkd_mcore.config import ConfigError, LossSection, TeacherEndpoint
from opkd_mcore.config.loss_rules import teacher_kind
from opkd_mcore.engine.lm_head import LmHeadInput
from opkd_mcore.losses import DenseTeacher, kd_loss
from opkd_mcore.losses.plan import resolve_loss_plan
from opkd_mcore.platform import device as platform_device
from opkd_mcore.train.objective import StepCounts, make_loss_fn

F32, BF16 = torch.float32, torch.bfloat16
TOPK = {"support": "teacher"}


@pytest.fixture
def on_device(monkeypatch):
    """`on_device(kind)` -> the device argument of the plan, with the machine made to look like:
    "cpu" (the C++ twin built), "cpu-no-twin", "gpu-like" (Triton usable), "npu-like" (neither)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # the interpreter would run Triton on CPU

    def setup(kind: str) -> str:
        if kind == "cpu" and not cpu_backend.available():
            pytest.skip("the C++ twin (opkd_kernels._cpu) is not built here")
        if kind == "cpu-no-twin":
            monkeypatch.setattr(cpu_backend, "available", lambda: False)
        if kind == "gpu-like":
            pytest.importorskip("triton")
            monkeypatch.setattr(platform_device, "triton_kernels_usable", lambda t: True)
            return "cuda"   # a device type only: nothing is allocated on it
        return {"npu-like": "npu"}.get(kind, "cpu")
    return setup


def case(device, dtype, teacher, **options):
    """(device kind, dtype, teacher kind, LossSection options)."""
    return device, dtype, teacher, options


OFF = (False, None, None, None)   # the fused LM head off: no kernels, engine or engine name
# case -> (logits backend, (fused head, head kernels, head engine, engine name for linear_kd_loss))
PLANS = {
    "cpu topk auto": (case("cpu", F32, "topk", **TOPK), ("cpp", OFF)),
    "cpu topk on": (case("cpu", F32, "topk", **TOPK, fused_lm_head="on"),
                    ("cpp", (True, "cpp", "chunked", "cpp"))),
    "cpu topk on rows": (case("cpu", F32, "topk", **TOPK, fused_lm_head="on", lm_head_engine="rows"),
                         ("cpp", (True, "cpp", "rows", "rows"))),
    "cpu in-step on": (case("cpu", F32, "in_step", fused_lm_head="on"),
                       ("cpp", (True, "cpp", "chunked", "cpp"))),
    "cpu hidden bf16 chunked": (case("cpu", BF16, "hidden", fused_lm_head="on", lm_head_engine="chunked"),
                                ("cpp", (True, "cpp", "chunked", "cpp"))),
    "cpu dense auto": (case("cpu", F32, "dense"), ("cpp", OFF)),
    "cpu impl cpp on": (case("cpu", F32, "topk", **TOPK, impl="cpp", fused_lm_head="on"),
                        ("cpp", (True, "cpp", "chunked", "cpp"))),
    "cpu reference": (case("cpu", F32, "topk", **TOPK, impl="reference"), ("torch", OFF)),
    "cpu policy gradient": (case("cpu", F32, "topk", **TOPK, form="policy_gradient"), (None, OFF)),
    "cpu head off": (case("cpu", F32, "topk", **TOPK, fused_lm_head="off"), ("cpp", OFF)),
    "cpu float64 auto": (case("cpu", torch.float64, "topk", **TOPK), ("torch", OFF)),
    "cpu-no-twin on": (case("cpu-no-twin", F32, "topk", **TOPK, fused_lm_head="on"),
                       ("torch", (True, "torch", "chunked", "torch"))),
    "gpu-like topk auto": (case("gpu-like", BF16, "topk", **TOPK),
                           ("triton", (True, "triton", "rows", "rows"))),
    "gpu-like in-step auto": (case("gpu-like", BF16, "in_step"),
                              ("triton", (True, "triton", "rows", "rows"))),
    "gpu-like hidden auto": (case("gpu-like", BF16, "hidden"), ("triton", (True, "triton", "rows", "rows"))),
    "gpu-like topk tiles": (case("gpu-like", BF16, "topk", **TOPK, lm_head_engine="tiles"),
                            ("triton", (True, "triton", "tiles", "triton"))),
    "gpu-like hidden chunked": (case("gpu-like", BF16, "hidden", lm_head_engine="chunked"),
                                ("triton", (True, "triton", "chunked", "chunked"))),
    "gpu-like dense auto": (case("gpu-like", BF16, "dense"), ("triton", OFF)),
    "gpu-like fused, head off": (case("gpu-like", BF16, "topk", **TOPK, impl="fused", fused_lm_head="off"),
                                 ("triton", OFF)),
    "gpu-like policy gradient": (case("gpu-like", BF16, "topk", **TOPK, form="policy_gradient"), (None, OFF)),
    "npu-like topk auto": (case("npu-like", BF16, "topk", **TOPK), ("torch", OFF)),
    "npu-like topk on": (case("npu-like", BF16, "topk", **TOPK, fused_lm_head="on"),
                         ("torch", (True, "torch", "chunked", "torch"))),
}


def _resolve(on_device, kind, dtype, teacher, options):
    return resolve_loss_plan(LossSection(**options), device=on_device(kind), dtype=dtype,
                             teacher_kind=teacher)


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_decisions(on_device, name):
    (kind, dtype, teacher, options), (logits, head) = PLANS[name]
    plan = _resolve(on_device, kind, dtype, teacher, options)
    assert plan.logits_backend == logits
    assert (plan.fused_lm_head, plan.lm_head_kernels, plan.lm_head_engine, plan.linear_engine) == head
    assert plan.kd_impl == ("reference" if logits in (None, "torch") else logits)
    assert plan.logits_reason and plan.lm_head_reason
    assert bool(plan.lm_head_engine_reason) == plan.fused_lm_head
    if plan.fused_lm_head and kind.startswith("cpu") and plan.linear_engine != "rows":
        # the name reaches a real engine of the kernels' own dispatch
        assert select_linear_engine(torch.zeros(2, 4, dtype=dtype), plan.linear_engine) is not None


def test_auto_says_why_the_fused_head_is_off(on_device):
    def reason(**options):
        teacher = "dense" if options.get("support") is None else "topk"
        return _resolve(on_device, "cpu", F32, teacher, options).lm_head_reason

    assert reason(**TOPK) == ("auto turns it on where the Triton tiles run; here the chunked cpp twin "
                              "would (use on)")
    assert reason() == "the teacher hands over full-vocabulary logits (output: dense)"
    assert reason(**TOPK, form="policy_gradient").startswith("loss.form: policy_gradient scores the sampled")
    assert reason(**TOPK, fused_lm_head=False) == "loss.fused_lm_head: off"


REFUSED = {  # case -> the start of the error
    "triton without a GPU": (case("cpu", F32, "topk", **TOPK, impl="triton"),
                             "loss.impl: 'triton' cannot run here"),
    "cpp without the twin": (case("cpu-no-twin", F32, "topk", **TOPK, impl="cpp"),
                             "loss.impl: 'cpp' cannot run here"),
    "cpp on a GPU": (case("gpu-like", BF16, "topk", **TOPK, impl="cpp"), "loss.impl: 'cpp' cannot run here"),
    "cpp with policy gradient": (case("cpu", F32, "topk", **TOPK, impl="cpp", form="policy_gradient"),
                                 "loss.impl: 'cpp' names a fused distillation kernel"),
    "tiles without Triton": (case("cpu", F32, "topk", **TOPK, fused_lm_head="on", lm_head_engine="tiles"),
                             "loss.fused_lm_head: 'on' cannot run: loss.lm_head_engine: tiles needs"),
    "on with a dense teacher": (case("gpu-like", BF16, "dense", fused_lm_head="on"),
                                "loss.fused_lm_head: 'on' cannot run: the teacher hands over full"),
    "on with policy gradient": (case("cpu", F32, "topk", **TOPK, fused_lm_head="on", form="policy_gradient"),
                                "loss.fused_lm_head: 'on' cannot run: loss.form: policy_gradient"),
    "on with reference": (case("gpu-like", BF16, "topk", **TOPK, fused_lm_head=True, impl="reference"),
                          "loss.fused_lm_head: 'on' cannot run: loss.impl: reference"),
    "on with float64": (case("cpu", torch.float64, "topk", **TOPK, fused_lm_head="on"),
                        "loss.fused_lm_head: 'on' cannot run: no fused LM-head kernel takes torch.float64"),
    "unknown impl": (case("cpu", F32, "topk", **TOPK, impl="cuda"), "loss.impl: expected one of"),
    "unknown engine": (case("cpu", F32, "topk", **TOPK, lm_head_engine="fastest"),
                       "loss.lm_head_engine: expected one of"),
    "unknown mode": (case("cpu", F32, "topk", **TOPK, fused_lm_head="sometimes"),
                     "loss.fused_lm_head: expected one of"),
    "beta out of range": (case("cpu", F32, "topk", **TOPK, beta=1.5),
                          "loss.beta: expected a number in [0, 1]"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_impossible_requests_name_the_key(on_device, name):
    (kind, dtype, teacher, options), start = REFUSED[name]
    with pytest.raises(ConfigError) as err:
        _resolve(on_device, kind, dtype, teacher, options)
    assert str(err.value).startswith(start), str(err.value)


def test_unknown_teacher_kind_is_refused():
    with pytest.raises(ValueError, match="^teacher_kind: expected one of"):
        resolve_loss_plan(LossSection(), device="cpu", dtype=F32, teacher_kind="logits")


def test_run_teacher_kind_from_the_config():
    assert teacher_kind([TeacherEndpoint(backend="vllm")]) == "topk"
    assert teacher_kind([TeacherEndpoint(backend="vllm", output="hidden")]) == "hidden"
    assert teacher_kind([TeacherEndpoint(backend="hf", output="dense")]) == "dense"
    assert teacher_kind([TeacherEndpoint(backend="megatron")]) == "in_step"


def test_plan_is_logged_once_in_one_line(on_device, caplog):
    loss = LossSection(fused_lm_head="on", lm_head_engine="rows", lm_head_chunk_mb=3, **TOPK)
    with caplog.at_level(logging.INFO, logger="opkd_mcore.losses.plan"):
        resolve_loss_plan(loss, device=on_device("cpu"), dtype=F32, teacher_kind="topk")
    (record,) = [r for r in caplog.records if r.name == "opkd_mcore.losses.plan"]
    line = record.getMessage()
    assert "\n" not in line
    for part in ("teacher: topk", "loss: fused kernels (cpp)", "loss.fused_lm_head: on (cpp kernels",
                 "lm_head_engine: rows", "chunk: 3 MiB", "objective: forward_kl, beta 0.5"):
        assert part in line, (part, line)


def test_plan_is_frozen_and_keeps_its_own_copy_of_the_section():
    loss = LossSection(**TOPK, fused_lm_head="on")
    plan = resolve_loss_plan(loss, device="cpu", dtype=F32, teacher_kind="topk")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fused_lm_head = False
    loss.aggregation = "seq-mean-token-sum"
    assert plan.loss.aggregation == "token-mean"


def test_objective_is_kd_loss_keywords():
    """The plan's objective maps 1:1 to `kd_loss`'s keywords and gives the loss those options give."""
    loss = LossSection(divergence="jsd", beta=0.3, temperature=1.5, support="union", k=3, mass="tail",
                       coverage_coef=0.2)
    plan = resolve_loss_plan(loss, device="cpu", dtype=F32, teacher_kind="dense")
    keywords = {name for name, p in inspect.signature(kd_loss).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(plan.kd_kwargs()) <= keywords
    assert plan.kd_kwargs() == {"divergence": "jsd", "beta": 0.3, "temperature": 1.5, "support": "union",
                                "k": 3, "mass": "tail", "coverage_coef": 0.2}
    g = torch.Generator().manual_seed(0)
    z, t = (torch.randn(5, 11, generator=g, dtype=torch.float64) for _ in range(2))
    expected = kd_loss(z, DenseTeacher(t), divergence="jsd", beta=0.3, temperature=1.5, support="union", k=3,
                       mass="tail", coverage_coef=0.2)
    torch.testing.assert_close(kd_loss(z, DenseTeacher(t), **plan.kd_kwargs(), impl="reference"), expected)


def test_hidden_states_reach_a_loss_only_when_the_plan_fuses_the_head():
    loss = LossSection(**TOPK, fused_lm_head="off")
    plan = resolve_loss_plan(loss, device="cpu", dtype=F32, teacher_kind="topk")
    head = LmHeadInput(torch.zeros(2, 4), torch.zeros(8, 4))
    batch = SimpleNamespace(loss_mask=torch.ones(2), seq_ids=torch.zeros(2, dtype=torch.long),
                            sequence_weights=None, num_sequences=1)
    with pytest.raises(ValueError, match="^logits_local: got an LmHeadInput, but the loss plan has"):
        make_loss_fn(plan, StepCounts(num_tokens=2, num_seqs=1))(head, batch)
