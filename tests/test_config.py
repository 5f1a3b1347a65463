"""Config schema: YAML + overrides, every rejection with its key path, resolved dump round trip."""
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import typing

import pytest
import yaml

from opkd_mcore.config import ConfigError, TrainConfig, dump_config, load_config, validate_config
from opkd_mcore.config.schema import OptimSection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_dir(tmp_path, name, heads=4, kv_heads=2, layers=4, vocab=64):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
        vocab_size=vocab, architectures=["Qwen3ForCausalLM"])))
    return str(d)


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A valid YAML file over a local 4-head / 2-KV-head / 4-layer checkpoint; returns its path."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    student = _hf_dir(tmp_path, "student")
    teacher = _hf_dir(tmp_path, "teacher", heads=8, kv_heads=4, layers=2)
    cfg = {
        "model": {"student": student},
        "parallel": {"tp": 1, "micro_batch_size": 2, "global_batch_size": 8},
        "loss": {"support": "teacher"},
        "rollout": {"prompts_per_step": 4, "n": 2},
        "teacher": {"teachers": [{"backend": "vllm", "model": teacher, "top_k": 8}]},
        "run": {"output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _reject(base, overrides, key_path, fragment=""):
    with pytest.raises(ConfigError) as err:
        load_config(base, overrides)
    msg = str(err.value)
    assert msg.startswith(key_path), msg
    assert fragment in msg, msg
    return msg


def test_base_config_loads_with_typed_overrides(base):
    cfg = load_config(base, ["loss.divergence=jsd", "loss.beta=0.3", "rollout.max_new_tokens=12",
                             "teacher.teachers.0.top_k=4", "loss.k=null", "data.shuffle=false"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.loss.divergence == "jsd" and cfg.loss.beta == pytest.approx(0.3)
    assert cfg.rollout.max_new_tokens == 12 and cfg.teacher.teachers[0].top_k == 4
    assert cfg.data.shuffle is False and cfg.loss.k is None
    # ints are accepted where floats are expected, and stay floats
    assert isinstance(load_config(base, ["optim.lr=1"]).optim.lr, float)


def test_resolved_dump_round_trips(base, tmp_path):
    cfg = load_config(base, ["loss.divergence=reverse_kl", "loss.mass=tail"])
    out = tmp_path / "resolved.yaml"
    dump_config(cfg, str(out))
    again = load_config(str(out))
    assert again == cfg
    assert yaml.safe_load(out.read_text())["loss"]["mass"] == "tail"


def test_shipped_configs_validate(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    recipe = load_config(os.path.join(ROOT, "configs", "qwen3_8b_from_32b.yaml"), check_files=False)
    assert recipe.model.student == "Qwen/Qwen3-8B" and recipe.parallel.world_size == 8
    from opkd_mcore.demo.run import demo_config_path

    demo = load_config(demo_config_path(), check_files=False)
    assert demo.teacher.teachers[0].backend == "vllm"
    # `opkd demo` on an accelerator: the teacher in the student's step, the same top-k objective
    from opkd_mcore.demo.run import accelerator_overrides

    gpu = load_config(demo_config_path(), accelerator_overrides(demo.teacher.teachers[0].top_k),
                      check_files=False)
    assert gpu.teacher.teachers[0].backend == "megatron" and gpu.loss.k == demo.teacher.teachers[0].top_k
    assert (gpu.loss.support, gpu.loss.mass) == (demo.loss.support, demo.loss.mass)


def test_four_gpu_config_passes_the_start_up_checks_on_its_model_shapes(tmp_path, monkeypatch):
    """configs/gpu_qwen3_8b_from_14b_x4.yaml over config.json files of the shapes the GPU lane writes
    (no weights) passes `opkd train --check`'s checks: TP=2 divides both models' heads, PP=2 both
    models' layers (the in-step teacher is built on the student's stages), 4 ranks hold one replica."""
    from opkd_mcore.data import ALPHABET
    from opkd_mcore.models.tiny import NAMED_SHAPES, make_char_tokenizer, tiny_hf_config
    from opkd_mcore.train.preflight import PreflightError, preflight

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dirs = {}
    for shape in ("qwen3-8b", "qwen3-14b"):
        dirs[shape] = tmp_path / shape
        dirs[shape].mkdir()
        tiny_hf_config("qwen3", NAMED_SHAPES[shape]).to_json_file(str(dirs[shape] / "config.json"))
    make_char_tokenizer(ALPHABET).save_pretrained(str(dirs["qwen3-8b"]))
    path = os.path.join(ROOT, "configs", "gpu_qwen3_8b_from_14b_x4.yaml")
    models = [f"model.student={dirs['qwen3-8b']}", f"teacher.teachers.0.model={dirs['qwen3-14b']}",
              f"run.output_dir={tmp_path / 'run'}"]
    cfg = load_config(path, models)
    preflight(cfg, probe_servers=False)
    par, (teacher,) = cfg.parallel, cfg.teacher.teachers
    assert (par.tp, par.pp, par.world_size, par.recompute) == (2, 2, 4, "full")
    assert teacher.backend == "megatron" and cfg.loss.support is None and cfg.optim.use_distributed_optimizer
    assert par.global_batch_size == cfg.rollout.prompts_per_step * cfg.rollout.n == 128
    with pytest.raises(ConfigError, match=r"tp\*pp\*cp = 4 does not divide the world size 2"):
        load_config(path, models + ["parallel.world_size=2"])
    # the student's 36 layers split in 3 stages, the teacher's 40 do not
    with pytest.raises(PreflightError, match="teacher.teachers.0.model"):
        preflight(load_config(path, models + ["parallel.tp=1", "parallel.pp=3", "parallel.world_size=3"]),
                  probe_servers=False)


@pytest.mark.parametrize("overrides, key_path, fragment", [
    (["loss.divergnce=jsd"], "loss.divergnce", "unknown key"),
    (["optimizer.lr=1"], "optimizer", "unknown key"),
    (["+loss.beta=0.2"], "+loss.beta", "not supported"),
    (["teacher.teachers.3.top_k=2"], "teacher.teachers.3", "out of range"),
    (["loss.beta=high"], "loss.beta", "expected a number"),
    (["parallel.tp=2.5"], "parallel.tp", "expected an integer"),
    (["parallel.tp=true"], "parallel.tp", "expected an integer"),
    (["data.shuffle=3"], "data.shuffle", "expected bool"),
    (["teacher.teachers.0.data_sources=math"], "teacher.teachers.0.data_sources", "expected a list"),
    (["loss.divergence=kl"], "loss.divergence", "expected one of"),
    (["loss.beta=1.5"], "loss.beta", "[0, 1]"),
    (["parallel.tp=3"], "parallel.tp", "does not divide the model's 4 attention heads"),
    (["parallel.tp=4"], "parallel.tp", "2 key/value heads"),
    (["parallel.pp=3"], "parallel.pp", "4 layers"),
    (["parallel.vpp=2"], "parallel.vpp", "pp > 1"),
    (["parallel.world_size=4", "parallel.micro_batch_size=3", "parallel.global_batch_size=9",
      "rollout.prompts_per_step=9", "rollout.n=1"], "parallel.global_batch_size", "not divisible"),
    (["parallel.global_batch_size=16"], "parallel.global_batch_size", "rollout.prompts_per_step"),
    (["parallel.world_size=3", "parallel.tp=2"], "parallel.tp", "world size 3"),
    (["loss.mass=raw", "loss.divergence=reverse_kl"], "loss.mass", "forward_kl only"),
    (["loss.support=union"], "loss.support", "dense"),
    (["loss.support=null"], "loss.support", "support: teacher"),
    (["loss.temperature=2.0"], "loss.temperature", "top-k"),
    (["loss.k=16"], "loss.k", "top_k"),
    (["loss.task_reward_coef=1.0"], "loss.task_reward_coef", "policy_gradient"),
    (["teacher.teachers.0.backend=remote"], "teacher.teachers.0.url", "base URL"),
    (["teacher.teachers.0.model=/no/such/dir"], "teacher.teachers.0.model", "no HF checkpoint"),
    (["model.student=/no/such/dir"], "model.student", "no HF checkpoint"),
    (["rollout.max_new_tokens=300"], "rollout.max_new_tokens", "max_model_len"),
    (["rollout.sample_seeds=batch"], "rollout.sample_seeds", "expected one of"),
    (["rollout.engine_in_process=true"], "rollout.engine_in_process", "controller.kind: ray"),
    (["optim.min_lr=1.0"], "optim.min_lr", "min_lr"),
    (["data.task=null"], "data.train_path", "synthetic"),
    (["data.train_path=prompts.csv"], "data.train_path", ".jsonl or .parquet"),
    (["data.train_path=/no/such.jsonl"], "data.train_path", "does not exist"),
    (["run.schedule=fully_async"], "run.schedule", "expected one of"),
    (["run.schedule=async"], "run.schedule", "needs controller.kind: ray"),
    (["optim.lr_decay_style=exp"], "optim.lr_decay_style", "expected one of"),
    (["optim.lrate=0.1"], "optim.lrate", "unknown key"),
    (["teacher.teachers.0.backend=tgi"], "teacher.teachers.0.backend", "expected one of"),
    (["weight_sync.every_steps=0"], "weight_sync.every_steps", "> 0"),
    (["run.steps=0"], "run.steps", "> 0"),
    (["controller.teacher_call_tokens=0"], "controller.teacher_call_tokens", "> 0"),
])
def test_rejections_name_the_key(base, overrides, key_path, fragment):
    _reject(base, overrides, key_path, fragment)


def test_dense_teacher_rules(base, tmp_path):
    dense = ["teacher.teachers.0.backend=megatron"]
    _reject(base, dense + ["loss.support=union"], "loss.k", "needs k")
    cfg = load_config(base, dense + ["loss.support=union", "loss.k=4", "loss.coverage_coef=0.5"])
    assert cfg.loss.support == "union"
    assert load_config(base, dense + ["loss.support=null", "loss.temperature=2.0"]).loss.support is None
    # a Megatron teacher is sharded like the student: TP must divide its heads too
    odd = _hf_dir(tmp_path, "odd_teacher", heads=6, kv_heads=3)
    _reject(base, dense + ["loss.support=null", f"teacher.teachers.0.model={odd}", "parallel.tp=2",
                           "parallel.world_size=2", "parallel.micro_batch_size=1"],
            "parallel.tp", "megatron teacher")


def test_teacher_routing_rules(base, tmp_path):
    other = _hf_dir(tmp_path, "teacher2", vocab=64)
    two = [f"teacher.teachers=[{{name: a, model: {other}, data_sources: [math]}}, "
           f"{{name: b, model: {other}, data_sources: [math, code]}}]"]
    _reject(base, two, "teacher.teachers.1.data_sources", "already routed")
    two_defaults = [f"teacher.teachers=[{{name: a, model: {other}}}, {{name: b, model: {other}}}]"]
    _reject(base, two_defaults, "teacher.teachers", "default teacher")
    mixed = [f"teacher.teachers=[{{name: a, model: {other}}}, {{name: b, model: {other}, "
             f"backend: megatron, data_sources: [code]}}]"]
    _reject(base, mixed, "teacher.teachers", "mixed")
    # the router keys teachers by name: a repeated name would silently replace a teacher
    same_name = [f"teacher.teachers=[{{model: {other}}}, {{model: {other}, data_sources: [code]}}]"]
    _reject(base, same_name, "teacher.teachers.1.name", "unique")


def test_world_size_comes_from_launcher(base, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(base, ["parallel.tp=2"])
    assert cfg.parallel.tp == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    _reject(base, [], "parallel.global_batch_size", "micro_batch_size*dp = 2*3")


# --- every float finite, every field in range -----------------------------------------------

def _float_keys(cls=TrainConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every float field of the schema (list sections: item 0)."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], prefix + f.name
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            keys += _float_keys(tp, path + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            keys += _float_keys(args[0], path + ".0.")
        elif tp is float or float in args:
            keys.append(path)
    return keys


FLOAT_KEYS = _float_keys()


def test_float_keys_cover_the_schema():
    assert len(FLOAT_KEYS) >= 17, FLOAT_KEYS
    assert {"optim.lr", "loss.beta", "rollout.gpu_memory_utilization"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1" + "0" * 400])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_floats_are_rejected_by_the_loader(base, key, value):
    _reject(base, [f"{key}={value}"], key, "finite")


def _set_path(cfg, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        cfg = cfg[int(part)] if part.isdigit() else getattr(cfg, part)
    setattr(cfg, leaf, value)


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_floats_are_rejected_in_python_built_configs(base, key):
    cfg = load_config(base)
    _set_path(cfg, key, math.nan)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: expected a finite number"):
        validate_config(cfg)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(OptimSection)
                                  if f.type in (float, "float")])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_optim_config_rejects_non_finite(name, value):
    with pytest.raises(ValueError, match=rf"^optim.{name}: expected a finite number"):
        OptimSection(**{name: value}).validate()


@pytest.mark.parametrize("overrides, key_path, fragment", [
    (["parallel.cp=0"], "parallel.cp", "> 0"),
    (["parallel.cp=2", "parallel.pp=2", "parallel.world_size=4"], "parallel.cp", "without pipeline stages"),
    (["parallel.cp=2", "parallel.world_size=2", "loss.aggregation=seq-mean-token-mean"], "loss.aggregation",
     "expected token-mean"),
    (["parallel.recompute=block"], "parallel.recompute", "expected one of ['none', 'selective', 'full']"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "parallel.pp=2", "parallel.world_size=4",
      "teacher.teachers.0.backend=megatron", "loss.support=null"], "parallel.sequence_parallel",
     "in-step teacher"),
    (["parallel.ep=2"], "parallel.ep", "MoE"),
    (["parallel.world_size=0"], "parallel.world_size", "> 0"),
    (["parallel.world_size=-2"], "parallel.world_size", "> 0"),
    (["loss.confidence_alpha=-0.5"], "loss.confidence_alpha", ">= 0"),
    (["loss.pg_coef=-1.0"], "loss.pg_coef", ">= 0"),
    (["loss.form=policy_gradient", "loss.task_reward_coef=-1.0"], "loss.task_reward_coef", ">= 0"),
    (["teacher.teachers.0.backend=megatron", "loss.k=65"], "loss.k", "vocabulary of 64"),
    (["rollout.top_k=-7"], "rollout.top_k", "-1 (off) or >= 1"),
    (["rollout.top_k=0"], "rollout.top_k", "-1 (off) or >= 1"),
    (["rollout.gpu_memory_utilization=7.5"], "rollout.gpu_memory_utilization", "(0, 1]"),
    (["rollout.gpu_memory_utilization=0.0"], "rollout.gpu_memory_utilization", "(0, 1]"),
    (["rollout.seed=-1"], "rollout.seed", "[0, 2147483647]"),
    (["rollout.seed=4294967296"], "rollout.seed", "[0, 2147483647]"),
    (["run.seed=-1"], "run.seed", "[0, 2147483647]"),
    (["data.seed=-3"], "data.seed", "[0, 2147483647]"),
    (["data.num_train=0"], "data.num_train", "> 0"),
    (["data.num_eval=-1"], "data.num_eval", ">= 0"),
    (["data.task_digits=1"], "data.num_train", "100 distinct 1-digit"),
    (["data.task_digits=200"], "data.task_digits", "rollout.max_model_len"),
    (["data.prompt_key="], "data.prompt_key", "non-empty"),
    (["data.messages_key="], "data.messages_key", "non-empty"),
    (["data.chat_template=jinja"], "data.chat_template", "expected one of"),
    (["data.overlong=truncate"], "data.overlong", "expected one of ['error', 'skip']"),
    (["data.rewards={math: my_pkg.rewards}"], "data.rewards.math", "module:function"),
    (["data.rewards={math: 'my-pkg:score'}"], "data.rewards.math", "module:function"),
    (["data.rewards={math: 'my_pkg:'}"], "data.rewards.math", "module:function"),
    (["data.rewards={'': exact_match}"], "data.rewards", "data_source names"),
    (["weight_sync.host="], "weight_sync.host", "host name or IP"),
    (["weight_sync.host=http://10.0.0.1"], "weight_sync.host", "no scheme"),
    (["teacher.teachers.0.name="], "teacher.teachers.0.name", "non-empty"),
    (["teacher.teachers.0.output=full"], "teacher.teachers.0.output", "expected one of"),
    (["teacher.teachers.0.output=dense"], "teacher.teachers.0.output", "megatron and hf"),
    (["teacher.teachers.0.offload=true"], "teacher.teachers.0.offload", "megatron"),
    (["teacher.teachers.0.dtype=float64"], "teacher.teachers.0.dtype", "expected one of"),
    (["teacher.teachers.0.backend=remote", "teacher.teachers.0.url=http://a:1", "teacher.teachers.0.dtype=float32"],
     "teacher.teachers.0.dtype", "vllm and hf backends only"),
    (["teacher.teachers.0.url=http://host:8000"], "teacher.teachers.0.url", "remote"),
    (["teacher.teachers.0.data_sources=['']"], "teacher.teachers.0.data_sources.0", "non-empty"),
    (["teacher.teachers.0.backend=remote", "teacher.teachers.0.url=localhost:8000"],
     "teacher.teachers.0.url", "base URL"),
    (["teacher.teachers.0.backend=remote", "teacher.teachers.0.url=http://a:1",
      "teacher.teachers.0.replica_urls=[ftp://b:2]"], "teacher.teachers.0.replica_urls.0", "base URL"),
    (["logging.wandb_project="], "logging.wandb_project", "non-empty"),
    (["run.output_dir=' '"], "run.output_dir", "directory"),
    (["optim.lr_decay_steps=-5"], "optim.lr_decay_steps", "> 0"),
    (["optim.lr_decay_style=cosine", "optim.warmup_steps=20"], "optim.lr_decay_steps",
     "defaults to run.steps"),
])
def test_out_of_range_values_name_the_key(base, overrides, key_path, fragment):
    _reject(base, overrides, key_path, fragment)


def test_range_boundaries_are_accepted(base):
    cfg = load_config(base, [
        "rollout.top_k=-1", "rollout.gpu_memory_utilization=1.0", "rollout.seed=2147483647",
        "data.num_eval=0", "data.seed=0", "run.seed=0", "loss.pg_coef=0.0",
        "loss.confidence_alpha=0.0", "data.task_digits=1", "data.num_train=100",
        "data.rewards={addition: exact_match, code: 'my_pkg.rewards:score'}",
        "data.chat_template=none", "weight_sync.host=node-1.cluster",
        "logging.console_every=0", "optim.lr_decay_steps=5", "teacher.teachers.0.dtype=float32"])
    assert cfg.rollout.top_k == -1 and cfg.teacher.teachers[0].dtype == "float32" and cfg.data.rewards["code"] == "my_pkg.rewards:score"
    assert load_config(base, ["rollout.top_k=1"]).rollout.top_k == 1


def test_teacher_output_and_offload(base, tmp_path):
    hf_dense = ["teacher.teachers.0.backend=hf", "teacher.teachers.0.output=dense"]
    # an hf teacher with dense output follows the dense (megatron) loss rules
    cfg = load_config(base, hf_dense + ["loss.support=null", "loss.temperature=2.0"])
    assert cfg.teacher.teachers[0].output == "dense"
    _reject(base, hf_dense + ["loss.support=union"], "loss.k", "needs k")
    # a megatron teacher always hands the loss dense logits (top-k is loss.support + loss.k)
    _reject(base, ["teacher.teachers.0.backend=megatron", "teacher.teachers.0.output=topk",
                   "loss.support=teacher", "loss.k=4"], "teacher.teachers.0.output", "loss.support: teacher")
    _reject(base, ["teacher.teachers.0.backend=megatron", "loss.support=null", "loss.confidence_alpha=1.0"],
            "loss.confidence_alpha", "inside")
    other = _hf_dir(tmp_path, "teacher2")
    mixed = [f"teacher.teachers=[{{name: a, model: {other}, backend: hf, output: dense}}, "
             f"{{name: b, model: {other}, data_sources: [code]}}]"]
    _reject(base, mixed, "teacher.teachers", "mixed")
    assert load_config(base, ["teacher.teachers.0.backend=megatron", "teacher.teachers.0.offload=true",
                              "loss.support=null"]).teacher.teachers[0].offload


def test_teacher_dtype_reaches_the_vllm_engine_config(base, monkeypatch):
    """`teacher.teachers.N.dtype` is what the scoring teacher's engine is built with (vLLM's own
    `auto` runs a float32 checkpoint in bfloat16)."""
    import opkd_mcore.train.teacher_setup as teacher_setup
    from opkd_mcore.train.teacher_setup import build_scoring_teacher

    built = []
    monkeypatch.setattr(teacher_setup, "VllmTeacher", lambda model, cfg: built.append((model, cfg)) or cfg)
    for dtype in ("float32", "auto"):
        cfg = load_config(base, [f"teacher.teachers.0.dtype={dtype}"])
        assert build_scoring_teacher(cfg).dtype == dtype
    assert [c.dtype for _, c in built] == ["float32", "auto"]
    # an hf teacher computes in the named dtype too (auto: float32)
    monkeypatch.setattr(teacher_setup, "TransformersTeacher", lambda model, k, dtype: dtype)
    import torch

    for dtype, expected in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        cfg = load_config(base, ["teacher.teachers.0.backend=hf", f"teacher.teachers.0.dtype={dtype}"])
        assert build_scoring_teacher(cfg) == expected


# --- vocabulary: tokenizers, not padded config.json sizes -----------------------------------

TOKENS = "0123456789+= abcdef"  # 3 special tokens + 19 characters = 22 ids


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny HF checkpoints with tokenizers: a student and teachers that differ in vocabulary."""
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    root = tmp_path_factory.mktemp("vocab")

    def save(name: str, vocab: int, alphabet: str = TOKENS) -> str:
        shape = TinyModelShape(vocab_size=vocab, hidden_size=32, num_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, intermediate_size=32)
        return save_tiny_hf_model(str(root / name), "qwen3", shape, alphabet=alphabet)

    out = dict(student=save("student", 32), padded=save("padded", 40),
               permuted=save("permuted", 32, TOKENS[::-1]), small=save("small", 8, TOKENS[:5]))
    # no tokenizer files, only config.json: the fallback compares vocab sizes
    for name, vocab in (("bare", 40), ("bare_small", 16)):
        os.makedirs(root / name)
        hf = json.loads((root / "student" / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**hf, "vocab_size": vocab}))
        out[name] = str(root / name)
    return out


def _pair(ckpts, teacher: str, *extra: str) -> list[str]:
    return [f"model.student={ckpts['student']}", f"teacher.teachers.0.model={ckpts[teacher]}", *extra]


def test_vocabulary_padding_is_accepted_when_tokenizers_agree(base, ckpts):
    # Qwen2.5-style: same tokenizer, config.json vocab_size padded differently (40 vs 32)
    cfg = load_config(base, _pair(ckpts, "padded"))
    assert cfg.teacher.teachers[0].model == ckpts["padded"]
    assert load_config(base, _pair(ckpts, "bare")).model.student == ckpts["student"]


@pytest.mark.parametrize("teacher, fragment", [
    ("permuted", "tokenizers differ"),  # same size, other ids
    ("small", "student tokenizer 22 tokens, teacher vocab_size 8"),
    ("bare_small", "student tokenizer 22 tokens, teacher vocab_size 16"),  # fallback: sizes only
])
def test_vocabulary_mismatch_is_refused(base, ckpts, teacher, fragment):
    _reject(base, _pair(ckpts, teacher), "teacher.teachers.0.model", fragment)


def test_dense_teacher_with_a_padded_vocabulary_is_accepted(base, ckpts):
    # the trainer keeps the student's ids of a wider dense teacher (tests/test_train_integration.py)
    dense = ["teacher.teachers.0.backend=megatron", "loss.support=null"]
    assert load_config(base, _pair(ckpts, "padded", *dense)).loss.support is None
    assert load_config(base, _pair(ckpts, "student", *dense)).loss.support is None


def test_student_tokenizer_must_fit_its_embedding(base, ckpts, tmp_path):
    student = _hf_dir(tmp_path, "tight_student", vocab=16)
    for name in os.listdir(ckpts["student"]):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(ckpts["student"], name), student)
    _reject(base, [f"model.student={student}"], "model.student", "22 tokens")


def test_vocabulary_without_tokenizers_warns(base, tmp_path, caplog):
    # the base checkpoints have no tokenizer files: padded sizes may differ, so only a warning
    padded = _hf_dir(tmp_path, "teacher_padded", vocab=96)
    with caplog.at_level(logging.WARNING, logger="opkd_mcore.config.validate"):
        load_config(base, [f"teacher.teachers.0.model={padded}"])
    assert "cannot check" in caplog.text and "96" in caplog.text


def test_overlap_param_gather_needs_the_distributed_optimizer_and_overlapped_grad_reduce(base):
    """The overlapped param all-gather is the distributed optimizer's (Megatron-LM also requires the
    overlapped grad reduction with it): refused by key before anything starts, accepted with both."""
    _reject(base, ["optim.overlap_param_gather=true"], "optim.overlap_param_gather",
            "use_distributed_optimizer=False")
    _reject(base, ["optim.overlap_param_gather=true", "optim.use_distributed_optimizer=true"],
            "optim.overlap_param_gather", "overlap_grad_reduce=False")
    cfg = load_config(base, ["optim.overlap_param_gather=true", "optim.use_distributed_optimizer=true",
                             "optim.overlap_grad_reduce=true"])
    assert cfg.optim.overlap_param_gather and cfg.optim.use_distributed_optimizer
