"""The loss path of a run, decided once: `resolve_loss_plan(loss, device=, dtype=, teacher_kind=)`.

A `LossPlan` holds every choice the step (`train/objective.py`) and the engine act on, each with the
reason the log prints:

* the objective: `kd_loss`'s seven keywords packed once as the kernels' `KdSpec` (`kd_kwargs()`);
* the logits backend of the unfused path (`loss.impl`): the Triton kernels, the C++ twin on CPU, or
  the torch reference path; none for the policy-gradient form (Megatron's cross entropy);
* whether the fused LM head runs (`loss.fused_lm_head`), its logits kernels, its engine (rows |
  chunked | tiles, `loss.lm_head_engine`) and the rows engine's chunk budget (`loss.lm_head_chunk_mb`).

It is resolved from the config, the device and the kind of teacher output the loss receives (top-k
rows, dense logits handed over, hidden states, or the in-step megatron teacher), before anything
starts, and logged in one line. An explicit request that cannot run raises `ConfigError` naming the
key; an `auto` choice falls back and says why. The rules that need no device are in
`config/loss_rules.py`, where config validation asks the same functions. The kernels' `select_*`
functions stay their own dispatch; the trainer hands them the plan's choices by name.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from opkd_kernels.fused_kd import KdSpec, select_backend
from opkd_mcore.config.checks import choice
from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.loss_rules import (
    HIDDEN_STATE_KINDS,
    TEACHER_KINDS,
    cross_tokenizer_mode,
    fused_lm_head_mode,
    lm_head_blocker,
)
from opkd_mcore.config.schema import FUSED_LM_HEAD_MODES, LM_HEAD_ENGINES, LOSS_FORMS, LOSS_IMPLS, LossSection
from opkd_mcore.losses.fused import backend_for
from opkd_mcore.losses.fused_linear import engine_name
from opkd_mcore.losses.validation import kd_kwargs, objective_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossPlan:
    """How a run's loss runs (module docstring). Built by `resolve_loss_plan`, never changed."""

    loss: LossSection                  # a copy of the section it was resolved from (aggregation, PG options)
    objective: KdSpec                  # kd_loss's objective keywords, packed once
    teacher_kind: str                  # one of config.loss_rules.TEACHER_KINDS
    device: str                        # the device type it was resolved for
    dtype: torch.dtype                 # the student's parameter dtype
    logits_backend: str | None         # "triton" | "cpp" | "torch" (reference); None: policy-gradient form
    logits_reason: str
    fused_lm_head: bool                # the last stage hands the loss hidden states + weight shard
    lm_head_reason: str
    lm_head_kernels: str | None = None        # fused head's logits kernels: "triton" | "cpp" | "torch"
    lm_head_engine: str | None = None         # "rows" | "chunked" | "tiles"; None while the head is off
    lm_head_engine_reason: str = ""
    lm_head_chunk_bytes: int | None = None    # rows engine: one chunk's logits budget; None: its default

    def kd_kwargs(self) -> dict:
        """The objective as `kd_loss` / `linear_kd_loss` keywords."""
        return kd_kwargs(self.objective)

    @property
    def kd_impl(self) -> str:
        """`kd_loss`'s `impl` on materialised logits: the chosen backend by name."""
        return "reference" if self.logits_backend in (None, "torch") else self.logits_backend

    @property
    def linear_engine(self) -> str | None:
        """The `engine` name `linear_kd_loss_with_stats` takes: the tiles are the Triton engine; the
        chunked engine off the Triton kernels is the twin of the head's kernels (cpp / torch)."""
        if self.lm_head_engine == "tiles":
            return "triton"
        if self.lm_head_engine == "chunked" and self.lm_head_kernels != "triton":
            return self.lm_head_kernels
        return self.lm_head_engine

    def describe(self) -> str:
        """Every decision in one line (what `resolve_loss_plan` logs)."""
        if self.logits_backend is None:
            logits = "Megatron's cross entropy"
        elif self.logits_backend == "torch":
            logits = "torch reference path"
        else:
            logits = f"fused kernels ({self.logits_backend})"
        head = f"off ({self.lm_head_reason})"
        if self.fused_lm_head:
            chunk = ""
            if self.lm_head_engine == "rows":
                mib = self.lm_head_chunk_bytes
                chunk = f", chunk: {mib >> 20} MiB" if mib is not None else ", chunk: default"
            head = (f"on ({self.lm_head_kernels} kernels, lm_head_engine: {self.lm_head_engine} "
                    f"[{self.lm_head_engine_reason}]{chunk}) [{self.lm_head_reason}]")
        o = self.objective
        objective = (f"{o.divergence}, beta {o.beta}, temperature {o.temperature}, support {o.support}, "
                     f"k {o.k}, mass {o.mass}, coverage_coef {o.coverage_coef}")
        across = cross_tokenizer_mode(self.loss.cross_tokenizer)
        if across != "off":   # a teacher with another tokenizer: the loss over aligned spans
            objective += f", cross_tokenizer {across}"
        return (f"loss plan ({self.device}, {str(self.dtype).removeprefix('torch.')}, teacher: "
                f"{self.teacher_kind}): loss: {logits} [{self.logits_reason}]; loss.fused_lm_head: {head}; "
                f"objective: {objective}")


def resolve_loss_plan(loss: LossSection, *, device: str | torch.device, dtype: torch.dtype,
                      teacher_kind: str) -> LossPlan:
    """The run's `LossPlan` for `device` (a device type such as "cpu", or a torch.device), the student's
    parameter `dtype` and the kind of teacher output the loss receives; logged once.
    `ConfigError` (a ValueError) naming the key when an explicit request cannot run here."""
    _check_choices(loss, teacher_kind)
    device = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    objective = _objective(loss)
    logits, logits_reason = _logits_backend(loss, device, dtype)
    kernels = engine_name(_probe(device, dtype), _engine_impl(loss.impl))
    fused, head_reason = _fused_lm_head(loss, teacher_kind, kernels, dtype)
    head = {}
    if fused:
        engine, engine_reason = _lm_head_engine(loss, teacher_kind, kernels)
        chunk_bytes = None if loss.lm_head_chunk_mb is None else loss.lm_head_chunk_mb << 20
        head = {"lm_head_kernels": kernels, "lm_head_engine": engine, "lm_head_engine_reason": engine_reason,
                "lm_head_chunk_bytes": chunk_bytes}
    plan = LossPlan(loss=dataclasses.replace(loss), objective=objective, teacher_kind=teacher_kind,
                    device=device, dtype=dtype, logits_backend=logits, logits_reason=logits_reason,
                    fused_lm_head=fused, lm_head_reason=head_reason, **head)
    logger.info("%s", plan.describe())
    return plan


def lm_head_engine_rule(loss: LossSection, teacher_kind: str, kernels: str | None) -> str | None:
    """The fused LM head's engine: "rows", "chunked", or None for the logits kernels' own (the Triton
    tiles; the chunked twin of cpp / torch). `kernels`: the head's logits kernels (None: unknown).

    `auto` takes `rows` where the Triton kernels run: forming the logits once per chunk of rows and
    the gradients in the forward does the 4 GEMMs of the unfused path instead of 6, 1.07-1.24x the
    GEMMs alone against 1.85-2.7x for the recomputing engines, with ~1.2 GiB of chunk buffers
    (docs/benchmarks.md, H100). Elsewhere `auto` keeps the chunked twin, which holds one
    [rows, 4096] block. A named engine is taken as asked (`rows` on any device, `loss.impl` picking
    its logits kernels); a named twin (cpp / torch) is never overridden."""
    impl = _engine_impl(loss.impl)
    if loss.lm_head_engine == "rows":
        return "rows"
    if impl not in ("auto", "triton"):   # cpp / torch named: the twin, as asked
        return None
    if loss.lm_head_engine == "chunked":
        return "chunked"
    if loss.lm_head_engine == "auto":
        if kernels == "triton":
            return "rows"
        if teacher_kind in HIDDEN_STATE_KINDS and loss.support is None:
            return "chunked"
    return None


# ---------------------------------------------------------------- the decisions
def _check_choices(loss: LossSection, teacher_kind: str) -> None:
    choice("loss.form", loss.form, LOSS_FORMS)
    choice("loss.impl", loss.impl, LOSS_IMPLS)
    choice("loss.fused_lm_head", fused_lm_head_mode(loss.fused_lm_head), FUSED_LM_HEAD_MODES)
    choice("loss.lm_head_engine", loss.lm_head_engine, LM_HEAD_ENGINES)
    if teacher_kind not in TEACHER_KINDS:
        raise ValueError(f"teacher_kind: expected one of {TEACHER_KINDS}, got {teacher_kind!r}")


def _objective(loss: LossSection) -> KdSpec:
    try:
        return objective_spec(**{f.name: getattr(loss, f.name) for f in dataclasses.fields(KdSpec)})
    except ValueError as err:   # the loss keyword's message, under the config key
        raise ConfigError(f"loss.{err}") from None


def _probe(device: str, dtype: torch.dtype) -> SimpleNamespace:
    """A stand-in for a tensor on `device` (a type): the dispatch functions read only its device type
    and dtype. Nothing is allocated (that would open a device context before the run set its device
    up), and a device type torch knows only once its plugin is imported (an NPU) works too."""
    return SimpleNamespace(device=SimpleNamespace(type=device), dtype=dtype)


def _engine_impl(impl: str) -> str:
    return {"fused": "auto"}.get(impl, impl)


def _logits_backend(loss: LossSection, device: str, dtype: torch.dtype) -> tuple[str | None, str]:
    """The kernels `kd_loss` runs on materialised logits, and why."""
    impl = loss.impl
    if loss.form == "policy_gradient":
        if impl not in ("auto", "reference"):
            raise ConfigError(f"loss.impl: {impl!r} names a fused distillation kernel, but "
                              "loss.form: policy_gradient uses Megatron's cross entropy; use auto")
        return None, "loss.form: policy_gradient scores the sampled token"
    if impl == "reference":
        return "torch", "loss.impl: reference"
    probe = _probe(device, dtype)
    name = backend_for(probe, _engine_impl(impl))
    if name is not None and select_backend(probe, name) is None:
        name = None
    if name is not None:
        return name, f"loss.impl: {impl}"
    if impl != "auto":
        raise ConfigError(f"loss.impl: {impl!r} cannot run here: no fused kernel for {dtype} logits on "
                          f"a {device} device (Triton needs a GPU or TRITON_INTERPRET=1; the C++ "
                          "twin needs the opkd_kernels._cpu extension); use impl: auto or reference")
    return "torch", f"loss.impl: auto; no fused kernel for {dtype} logits on a {device} device"


def _fused_lm_head(loss: LossSection, teacher_kind: str, kernels: str | None,
                   dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the fused LM head runs, and why. `auto`: where the Triton tiles run and the objective
    and teacher are covered; the chunked twin on CPU / NPU trades one more pass for memory, so it
    runs only when asked for (`on`)."""
    mode = fused_lm_head_mode(loss.fused_lm_head)
    if mode == "off":
        return False, "loss.fused_lm_head: off"
    blocker = lm_head_blocker(loss, teacher_kind)
    if blocker is not None:
        if mode == "on":
            raise ConfigError(blocker.plan_message())
        return False, blocker.reason
    why = None
    if kernels is None:
        why = f"no fused LM-head kernel takes {dtype}"
    elif mode == "auto" and kernels != "triton":
        why = f"auto turns it on where the Triton tiles run; here the chunked {kernels} twin would (use on)"
    elif loss.lm_head_engine == "tiles" and kernels != "triton":
        why = f"loss.lm_head_engine: tiles needs the Triton kernels; here the chunked {kernels} twin runs"
    if why is None:
        return True, f"loss.fused_lm_head: {mode}"
    if mode == "on":
        raise ConfigError(f"loss.fused_lm_head: 'on' cannot run: {why}")
    return False, why


def _lm_head_engine(loss: LossSection, teacher_kind: str, kernels: str) -> tuple[str, str]:
    """The engine by name ("rows" | "chunked" | "tiles"), and why."""
    engine = lm_head_engine_rule(loss, teacher_kind, kernels)
    if engine is None:   # the kernels' own engine
        engine = "tiles" if kernels == "triton" else "chunked"
    if loss.lm_head_engine == engine:
        return engine, f"loss.lm_head_engine: {engine}"
    if _engine_impl(loss.impl) not in ("auto", "triton"):
        return engine, f"loss.impl: {loss.impl} names the chunked {kernels} twin"
    if engine == "rows":
        return engine, "auto: rows where the Triton kernels run"
    twin = "Triton row kernels" if kernels == "triton" else f"{kernels} twin"
    return engine, f"auto: the chunked engine ({twin})"
