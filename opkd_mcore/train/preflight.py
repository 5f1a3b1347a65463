"""Checks before anything starts, beyond what the config alone shows: the models Megatron will build,
the student's tokenizer, the prompts, the output directory and the teacher servers.

`opkd train` runs them before any engine starts (under torchrun and under the Ray controller), and
`opkd train --check` runs only them. They start nothing and write nothing; each check runs, and the
errors come back together in one `PreflightError`, one line each, every line starting with the key
to change. What needs no file, model or server stays in `config/validate.py`.
"""
from __future__ import annotations

import os

from opkd_mcore.config import ConfigError
from opkd_mcore.config.loss_rules import cross_tokenizer_mode, teacher_output
from opkd_mcore.config.model_checks import TOKENIZER_FILES, load_tokenizer_info, model_shape
from opkd_mcore.config.schema import ParallelSection, TeacherEndpoint, TrainConfig
from opkd_mcore.models import get_bridge, load_hf_config
from opkd_mcore.models.builder import transformer_engine_usable
from opkd_mcore.platform import is_cpu
from opkd_mcore.teacher.base import TeacherError
from opkd_mcore.teacher.remote import MaxLogprobsError, RemoteTeacherConfig, RemoteVllmTeacher
from opkd_mcore.train.checkpoint import check_run_dir
from opkd_mcore.train.components import load_train_data

# One probe request: a server that is up answers a listing or a 2-token prompt in well under a
# second; this bounds the wait for one that accepts the connection and then hangs.
PROBE_TIMEOUT_S = 30.0


class PreflightError(ConfigError):
    """Every problem the start-up checks found; `errors` holds one line per problem."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = list(errors)


def preflight(cfg: TrainConfig, *, resume: bool = False, export_only: bool = False,
              overwrite: bool = False, probe_servers: bool = True, check_prompts: bool = True) -> None:
    """Raise `PreflightError` listing every problem of a validated `cfg` that would stop the run after
    its engines started. `probe_servers`: ask each remote teacher server for its model and limits.
    `check_prompts`: read, check and tokenize the prompts (`--check`; a run does it first thing when it
    builds its parts, before any engine, so it is not done twice)."""
    errors = _check_models(cfg) + _lines(_check_transformer_engine, cfg)
    tokenizer = _lines(_check_student_tokenizer, cfg.model.student)
    errors += tokenizer
    if check_prompts and not tokenizer:  # the prompts are measured with the student's tokenizer
        errors += _lines(_check_data, cfg)
    errors += _lines(check_run_dir, cfg, resume=resume, export_only=export_only, overwrite=overwrite)
    if probe_servers:
        errors += _check_servers(cfg)
    if errors:
        raise PreflightError(errors)


def _lines(check, *args, **kwargs) -> list[str]:
    """The error lines of one check: none, or the `ConfigError`'s."""
    try:
        check(*args, **kwargs)
    except PreflightError as err:
        return err.errors
    except ConfigError as err:
        return str(err).splitlines()
    return []


# ------------------------------------------------------------------ models and tokenizer


def _check_models(cfg: TrainConfig) -> list[str]:
    """Megatron builds the student and a megatron teacher: each needs a bridge for its architecture
    that takes its config and the parallel layout."""
    megatron = [("model.student", cfg.model.student)]
    megatron += [(f"teacher.teachers.{i}.model", t.model) for i, t in enumerate(cfg.teacher.teachers)
                 if t.backend == "megatron"]
    errors = []
    for key, model in megatron:
        errors += _lines(_check_bridge, key, model, cfg.parallel)
    return errors


def _check_transformer_engine(cfg: TrainConfig) -> None:
    """CP and sequence parallelism exist only in Transformer Engine's layers; without TE (any CPU, or
    a GPU without the package) the student gets the local spec, which has neither."""
    if transformer_engine_usable(cfg.run.device):
        return
    where = ("the device is the CPU" if is_cpu(cfg.run.device)
             else "the transformer_engine package is not installed")
    lines = []
    if cfg.parallel.cp > 1:
        lines.append(f"parallel.cp: {cfg.parallel.cp} needs Transformer Engine (its attention exchanges "
                     f"keys and values between the CP ranks), but {where}; use parallel.cp: 1")
    if cfg.parallel.sequence_parallel:
        lines.append(f"parallel.sequence_parallel: needs Transformer Engine (the local layers' norms do "
                     f"not split the sequence), but {where}; use parallel.sequence_parallel: false")
    if lines:
        raise PreflightError(lines)


def _check_bridge(key: str, model: str, par: ParallelSection) -> None:
    if not os.path.isdir(model):  # a hub id: validation knows its shape and family (KNOWN_MODEL_SHAPES)
        return
    try:
        bridge = get_bridge(load_hf_config(model))
    except (ValueError, OSError) as err:
        raise ConfigError(f"{key}: {err} ({model})") from None
    try:
        bridge.check_parallel(par.tp, par.pp, par.vpp, par.ep, par.etp)
    except ValueError as err:
        raise ConfigError(f"parallel.{err} (the layout of {key}, {model})") from None


def _check_student_tokenizer(model: str) -> None:
    """The student's tokenizer files exist (validation loads them when they do): without them
    transformers builds an empty tokenizer of the config's family, and every prompt becomes <unk>."""
    if not os.path.isdir(model):  # a hub id is fetched by the run itself; nothing is downloaded here
        return
    if not any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
        raise ConfigError(f"model.student: {model!r} has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)}); the rollout and the prompts need it")


# ------------------------------------------------------------------ prompts


def _check_data(cfg: TrainConfig) -> None:
    """The prompts as the run reads them: every row of the files (or the synthetic task) checked, and
    every prompt tokenized and measured against the rollout's context (`data.overlong`)."""
    try:
        load_train_data(cfg)
    except ConfigError:
        raise
    except (ValueError, OSError, TypeError, KeyError) as err:
        raise ConfigError(f"data: {err}") from None


# ------------------------------------------------------------------ teacher servers


def _check_servers(cfg: TrainConfig) -> list[str]:
    """Each server of each remote teacher, asked once: what it serves, and whether it can score (every
    id the student can emit; across tokenizers, every id of the teacher's own tokenizer)."""
    shape = model_shape("model.student", cfg.model.student, check_files=True)
    student_vocab = shape["vocab"] if shape else None
    errors = []
    for i, t in enumerate(cfg.teacher.teachers):
        if t.backend != "remote":
            continue
        path = f"teacher.teachers.{i}"
        across = cross_tokenizer_mode(cfg.loss.cross_tokenizer) != "off"
        if across:
            student_vocab = load_tokenizer_info(f"{path}.model", t.model, {}).size
        urls = [(f"{path}.url", t.url)]
        urls += [(f"{path}.replica_urls.{j}", url) for j, url in enumerate(t.replica_urls)]
        for key, url in urls:
            errors += _lines(_probe_server, path, key, url, t, cfg.rollout.max_model_len, student_vocab,
                             "teacher" if across else "student")
    return errors


def _probe_server(path: str, key: str, url: str, t: TeacherEndpoint, max_model_len: int,
                  student_vocab: int | None, tokenizer_of: str = "student") -> None:
    """The server lists a model whose context holds the rollout's longest sequence, takes every id the
    student can emit, and returns `top_k` logprobs (or hidden states): the client's own first checks,
    made once, without retries."""
    output = "hidden" if teacher_output(t) == "hidden" else "topk"
    client = RemoteVllmTeacher(RemoteTeacherConfig(
        url=url, k=t.top_k, output=output, scoring=t.scoring, student_vocab_size=student_vocab,
        tokenizer_of=tokenizer_of, timeout_s=PROBE_TIMEOUT_S, max_retries=0))
    try:
        served = client.served_model()
        client.check_server()
        _check_served_length(key, url, served, max_model_len, client.scoring)
    except MaxLogprobsError as err:
        raise ConfigError(f"{path}.top_k: {err}") from None
    except TeacherError as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_served_length(key: str, url: str, served: dict, max_model_len: int, scoring: str) -> None:
    # prompt logprobs score the whole sequence as a prompt, and vLLM's generate runner refuses a
    # prompt that leaves no position for the one token it generates; the pooling runner (hidden
    # states, and the device-scoring server) does not
    need = max_model_len + (scoring == "prompt_logprobs")
    length = served.get("max_model_len")
    if isinstance(length, int) and length < need:
        raise ConfigError(f"{key}: teacher server {url} serves {served['id']!r} with max_model_len "
                          f"{length}; scoring the rollout's longest sequences (rollout.max_model_len = "
                          f"{max_model_len}) needs {need} (restart it with --max-model-len {need})")
