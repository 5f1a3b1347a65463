"""Config checks of `loss.cross_tokenizer`: a teacher with another tokenizer is refused without it
(and the message says how to allow it), accepted with it, and the settings a cross-tokenizer run
cannot honour are refused naming their key."""
from __future__ import annotations

import pytest
import yaml

from opkd_mcore.config import ConfigError, load_config
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._tokenizers import CHARS, digit_pair_tokenizer

SHAPE = TinyModelShape(vocab_size=160, hidden_size=32, num_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, intermediate_size=32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("xtok")
    return dict(student=save_tiny_hf_model(str(root / "student"), "qwen3", SHAPE, alphabet=CHARS),
                pairs=save_tiny_hf_model(str(root / "pairs"), "qwen3", SHAPE,
                                         tokenizer=digit_pair_tokenizer()))


@pytest.fixture
def base(tmp_path, ckpts, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = {"model": {"student": ckpts["student"]},
           "parallel": {"tp": 1, "micro_batch_size": 2, "global_batch_size": 8},
           "loss": {"support": "teacher", "cross_tokenizer": "gold"},
           "rollout": {"prompts_per_step": 4, "n": 2},
           "teacher": {"teachers": [{"backend": "vllm", "model": ckpts["pairs"], "top_k": 8}]},
           "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _reject(base, overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(base, overrides)
    assert str(err.value).startswith(key), str(err.value)
    assert fragment in str(err.value), str(err.value)


def test_another_tokenizer_is_refused_without_cross_tokenizer(base):
    _reject(base, ["loss.cross_tokenizer=off"], "teacher.teachers.0.model",
            "set loss.cross_tokenizer: exact | uld | gold")


@pytest.mark.parametrize("mode", ["exact", "uld", "gold"])
def test_another_tokenizer_is_accepted_with_cross_tokenizer(base, mode):
    cfg = load_config(base, [f"loss.cross_tokenizer={mode}", "loss.gold_uld_weight=0.5"])
    assert cfg.loss.cross_tokenizer == mode and cfg.loss.gold_uld_weight == 0.5


@pytest.mark.parametrize("overrides, key, fragment", [
    (["loss.cross_tokenizer=bpe"], "loss.cross_tokenizer", "bpe"),
    (["loss.gold_exact_weight=-1"], "loss.gold_exact_weight", ""),
    (["loss.form=policy_gradient", "loss.kl_estimator=k3"], "loss.form", "use loss.form: logit"),
    (["teacher.teachers.0.backend=hf", "teacher.teachers.0.output=dense", "loss.support=null"],
     "loss.support", "set loss.support: teacher"),
    (["teacher.teachers.0.backend=hf", "teacher.teachers.0.output=dense"], "loss.k", "top-k"),
    (["loss.confidence_alpha=1.0"], "loss.confidence_alpha", "use 0"),
    (["controller.kind=ray"], "controller.kind", "torchrun"),
    (["loss.fused_lm_head=on"], "loss.fused_lm_head", "cross_tokenizer"),
    (["teacher.teachers.0.backend=self", "teacher.teachers.0.model=", "loss.k=4"],
     "teacher.teachers.0.backend", "the student's tokenizer"),
    (["data.teacher_prompt_key=solution"], "data.teacher_prompt_key", "not wired"),
])
def test_settings_a_cross_tokenizer_run_cannot_honour(base, overrides, key, fragment):
    _reject(base, overrides, key, fragment)


def test_a_remote_teacher_needs_its_tokenizer_here(base, ckpts, tmp_path):
    remote = ["teacher.teachers.0.backend=remote", "teacher.teachers.0.url=http://127.0.0.1:9"]
    _reject(base, [*remote, "teacher.teachers.0.model="], "teacher.teachers.0.model", "tokenizer")
    _reject(base, [*remote, f"teacher.teachers.0.model={tmp_path}"], "teacher.teachers.0.model",
            "no tokenizer files")
    cfg = load_config(base, [*remote, f"teacher.teachers.0.model={ckpts['pairs']}"])
    assert cfg.loss.cross_tokenizer == "gold"
