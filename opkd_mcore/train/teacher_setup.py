"""Which teachers a run has and where each one runs.

* Scoring teachers (`vllm`, `remote`, `hf`) answer each step's samples on global rank 0 (in an
  SPMD job) before the student's update: top-k rows, or full-vocabulary logits for an `hf`
  teacher with `output: dense` (tiny CPU runs: rank 0 then shares those logits with every rank).
* A `megatron` teacher is a `MegatronTeacher` inside the SPMD job, on the student's parallel
  groups, run micro-batch by micro-batch inside the student's step (`engine/teacher_in_step.py`):
  its TP-sharded logits never leave the rank that uses them.
* A `self` teacher is the student (`engine/self_teacher.py`): with dense output it runs in the step
  like a megatron teacher, on the student's own chunks (`weights: current`), on a frozen copy loaded
  from the student's checkpoint (`initial`: a megatron teacher of that directory) or on a moving
  average of the student (`ema`); with top-k output the rollout engine scores with prompt logprobs
  (`teacher/rollout_teacher.py`).
* With `loss.cross_tokenizer` the run's one teacher is wrapped in a `CrossTokenizerScorer` (rank 0):
  it re-tokenizes each sample for the teacher and pairs the two sides by span; a megatron teacher
  then still runs in the step, on the teacher-side tokens the wrapper built.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

from opkd_mcore.config.loss_rules import cross_tokenizer_mode, runs_in_step
from opkd_mcore.config.model_checks import load_run_tokenizer
from opkd_mcore.config.schema import TeacherEndpoint, TrainConfig
from opkd_mcore.config.validate import teacher_output
from opkd_mcore.engine.self_teacher import CurrentWeightsTeacher, EmaTeacher
from opkd_mcore.engine.teacher_in_step import InStepTeacher
from opkd_mcore.models import TORCH_DTYPES, load_hf_config
from opkd_mcore.teacher.cross_tokenizer import CrossTokenizerScorer
from opkd_mcore.teacher.hf_teacher import TransformersTeacher
from opkd_mcore.teacher.hidden_states import load_output_weight_shard
from opkd_mcore.teacher.megatron_teacher import MegatronTeacher, MegatronTeacherConfig
from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher
from opkd_mcore.teacher.rollout_teacher import RolloutEngineTeacher
from opkd_mcore.teacher.router import TeacherRouter
from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

logger = logging.getLogger(__name__)


def in_step_endpoint(cfg: TrainConfig) -> TeacherEndpoint | None:
    """The in-step teacher of the run (`megatron`, or `self` with dense output; validation allows at most
    one, alone), or None."""
    return next((t for t in cfg.teacher.teachers if runs_in_step(t)), None)


def in_step_model(cfg: TrainConfig, t: TeacherEndpoint) -> str:
    """The HF checkpoint an in-step teacher is built from: the student's for a self teacher."""
    return cfg.model.student if t.backend == "self" else t.model


def with_hidden_teacher_head(cfg: TrainConfig, shard, dtype, device=None):
    """`shard` (a `stages.ShardLayout`) with this TP rank's rows of the output weight of the run's
    hidden-state teacher (`output: hidden`), read from its HF checkpoint; unchanged without one."""
    t = next((t for t in cfg.teacher.teachers if teacher_output(t) == "hidden"), None)
    if t is None:
        return shard
    from megatron.core import parallel_state as ps

    weight = load_output_weight_shard(t.model, shard.padded_vocab, ps.get_tensor_model_parallel_rank(),
                                      ps.get_tensor_model_parallel_world_size(), dtype, device)
    vocab = load_hf_config(t.model).vocab_size
    logger.info("teacher %s: hidden states; its output weight held here, %s rows of %s", t.name,
                tuple(weight.shape), vocab)
    return dataclasses.replace(shard, teacher_weight=weight,
                               teacher_vocab=min(vocab, shard.vocab_size or vocab))


def _one_teacher(t: TeacherEndpoint, cfg: TrainConfig, student_vocab: int | None, rollout=None):
    if t.backend == "self":  # top-k output (dense runs in the step): the rollout engine scores
        if rollout is None:
            raise ValueError(f"teacher {t.name!r}: a self teacher with top-k output scores with the rollout "
                             "engine of this process, and there is none here")
        return RolloutEngineTeacher(rollout, k=t.top_k, name=t.name)
    if t.backend == "vllm":
        # the rollout's context: the teacher scores a sample that fills it (its last token by the
        # logprobs of a token sampled after the others, see vllm_teacher)
        return VllmTeacher(t.model, VllmTeacherConfig(
            k=t.top_k, max_model_len=cfg.rollout.max_model_len, seed=cfg.rollout.seed, dtype=t.dtype,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, scoring=t.scoring,
            output="hidden" if teacher_output(t) == "hidden" else "topk"))
    if t.backend == "remote":
        # the server is asked once whether it can score every id the student may sample (across
        # tokenizers: every id of the teacher's tokenizer, which then writes what it is sent)
        output = "hidden" if teacher_output(t) == "hidden" else "topk"
        across = cross_tokenizer_mode(cfg.loss.cross_tokenizer) != "off"
        return RemoteVllmTeacher(RemoteTeacherConfig(url=t.url, k=t.top_k, student_vocab_size=student_vocab,
                                                     scoring=t.scoring, output=output,
                                                     tokenizer_of="teacher" if across else "student"))
    if t.backend == "hf":
        dtype = TORCH_DTYPES["float32" if t.dtype == "auto" else t.dtype]
        # dense: raw logits; kd_loss applies loss.temperature to dense teacher logits itself
        return TransformersTeacher(t.model, k=None if teacher_output(t) == "dense" else t.top_k, dtype=dtype)
    raise ValueError(f"teacher {t.name!r}: backend {t.backend!r} is not a scoring teacher "
                     "(a megatron teacher runs inside the student's step)")


def _urls(t: TeacherEndpoint) -> list:
    return [t.url, *t.replica_urls] if t.replica_urls else [t.url]


def _replicas(t: TeacherEndpoint, cfg: TrainConfig, student_vocab: int | None, rollout=None) -> list:
    return [_one_teacher(dataclasses.replace(t, url=url), cfg, student_vocab, rollout) for url in _urls(t)]


def build_scoring_teacher(cfg: TrainConfig, student_vocab: int | None = None, rollout=None):
    """Rank 0's teacher: one teacher, a router over several (by data source) and their replicas,
    or None when the run's teacher runs inside the step (`megatron`, `self` with dense output); across
    tokenizers the `CrossTokenizerScorer` around the run's one teacher. `rollout`: the student's rollout
    engine, which a `self` teacher with top-k output scores with."""
    if cross_tokenizer_mode(cfg.loss.cross_tokenizer) != "off":
        return cross_tokenizer_scorer(cfg)
    if in_step_endpoint(cfg) is not None:
        return None
    teachers = cfg.teacher.teachers
    if len(teachers) == 1 and not teachers[0].replica_urls:
        return _one_teacher(teachers[0], cfg, student_vocab, rollout)

    by_name = {t.name: _replicas(t, cfg, student_vocab, rollout) for t in teachers}
    default = next((t.name for t in teachers if not t.data_sources), None)
    return TeacherRouter(by_name, field="teacher", default=default)


def cross_tokenizer_scorer(cfg: TrainConfig) -> CrossTokenizerScorer:
    """The run's one teacher (validation allows one) behind the re-tokenizing wrapper; a megatron
    teacher scores in the step, so the wrapper then only builds its sequences."""
    t = cfg.teacher.teachers[0]
    teacher_tok = load_run_tokenizer("teacher.teachers.0.model", t.model)
    inner = None
    if t.backend != "megatron":   # the server must accept every teacher id the wrapper may send
        replicas = _replicas(t, cfg, len(teacher_tok))
        inner = replicas[0] if len(replicas) == 1 else TeacherRouter({t.name: replicas}, field="teacher",
                                                                     default=t.name)
    where = ("in the student's step" if t.backend == "megatron" else
             f"served at {', '.join(_urls(t))}" if t.backend == "remote" else "in this process")
    logger.info("teacher %s across tokenizers (loss.cross_tokenizer: %s): %s teacher %s, its tokenizer "
                "(%d ids) read from %s", t.name, cross_tokenizer_mode(cfg.loss.cross_tokenizer), t.backend,
                where, len(teacher_tok), t.model)
    return CrossTokenizerScorer(inner, load_run_tokenizer("model.student", cfg.model.student), teacher_tok,
                                chat_template=cfg.data.chat_template, name=t.name, k=cfg.loss.k,
                                temperature=cfg.loss.temperature,
                                max_len=cfg.rollout.max_model_len if t.backend == "vllm" else None)


def build_in_step_teacher(cfg: TrainConfig, padded_vocab: int, student_vocab: int):
    """The run's in-step teacher on this rank (collective: every rank calls it), or None. A `self`
    teacher with the current weights needs the student's chunks: it comes back as the function of them
    that builds it (`components.build_student` calls it). Across tokenizers a megatron teacher keeps
    its own vocabulary (its logits are aligned with the student's after the step)."""
    t = in_step_endpoint(cfg)
    if t is None:
        return None
    if t.backend == "self" and t.weights == "current":
        logger.info("teacher %s: the student's own chunks, a no-grad forward in its step (no copy)", t.name)
        return functools.partial(CurrentWeightsTeacher, vocab_size=student_vocab, name=t.name)
    import torch

    own = cross_tokenizer_mode(cfg.loss.cross_tokenizer) != "off"
    vocab = load_hf_config(t.model).vocab_size if own else student_vocab
    ema = t.backend == "self" and t.weights == "ema"
    dtype = torch.float32 if ema else getattr(torch, cfg.model.params_dtype)  # an average needs the bits
    teacher = MegatronTeacher(in_step_model(cfg, t), MegatronTeacherConfig(
        params_dtype=dtype, offload_between_calls=t.offload, padded_vocab=padded_vocab))
    in_step = (EmaTeacher(teacher, vocab_size=student_vocab, decay=t.ema_decay, name=t.name) if ema
               else InStepTeacher(teacher, vocab_size=vocab, own_vocabulary=own))
    what = {"megatron": "Megatron", "initial": "the student's initial weights, frozen",
            "ema": f"an EMA of the student (decay {t.ema_decay})"}
    what = what[t.weights if t.backend == "self" else t.backend]
    logger.info("teacher %s: %s, in the student's step (%d parameters on this rank%s%s)", t.name, what,
                in_step.num_parameters(), ", offloaded between steps" if t.offload else "",
                ", on its own tokens" if own else "")
    return in_step


def route_data(cfg: TrainConfig, data: dict) -> dict:
    """Per-prompt data with the teacher it is routed to under key `teacher`."""
    source = data.get("data_source")
    for t in cfg.teacher.teachers:
        if source in t.data_sources:
            return {**data, "teacher": t.name}
    return dict(data)
