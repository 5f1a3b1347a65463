"""Config schema: YAML + overrides, every rejection with its key path, resolved dump round trip."""
import json
import os

import pytest
import yaml

from opkd_mcore.config import ConfigError, TrainConfig, dump_config, load_config

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
    demo = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), check_files=False)
    assert demo.teacher.teachers[0].backend == "vllm"


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
    (["optim.min_lr=1.0"], "optim.min_lr", "min_lr"),
    (["data.task=null"], "data.train_path", "synthetic"),
    (["data.train_path=prompts.csv"], "data.train_path", ".jsonl or .parquet"),
    (["data.train_path=/no/such.jsonl"], "data.train_path", "does not exist"),
    (["run.schedule=async"], "run.schedule", "expected one of"),
    (["optim.lr_decay_style=exp"], "optim.lr_decay_style", "expected one of"),
    (["optim.lrate=0.1"], "optim.lrate", "unknown key"),
    (["teacher.teachers.0.backend=tgi"], "teacher.teachers.0.backend", "expected one of"),
    (["weight_sync.every_steps=0"], "weight_sync.every_steps", "> 0"),
    (["run.steps=0"], "run.steps", "> 0"),
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
    two = [f"teacher.teachers=[{{model: {other}, data_sources: [math]}}, "
           f"{{model: {other}, data_sources: [math, code]}}]"]
    _reject(base, two, "teacher.teachers.1.data_sources", "already routed")
    two_defaults = [f"teacher.teachers=[{{model: {other}}}, {{model: {other}}}]"]
    _reject(base, two_defaults, "teacher.teachers", "default teacher")
    mixed = [f"teacher.teachers=[{{model: {other}}}, {{model: {other}, backend: megatron, "
             f"data_sources: [code]}}]"]
    _reject(base, mixed, "teacher.teachers", "mixed")
    wrong_vocab = _hf_dir(tmp_path, "teacher3", vocab=96)
    _reject(base, [f"teacher.teachers.0.model={wrong_vocab}"], "teacher.teachers.0.model", "vocabulary")


def test_world_size_comes_from_launcher(base, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(base, ["parallel.tp=2"])
    assert cfg.parallel.tp == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    _reject(base, [], "parallel.global_batch_size", "micro_batch_size*dp = 2*3")
