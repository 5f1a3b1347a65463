"""Numbers as users write them: every float field takes `1e-5` and friends in a file and in an override
(YAML 1.1 reads them as strings), integer fields take integers only, and an LR decay shorter than the
run is refused."""
from __future__ import annotations

import pytest
import yaml

from opkd_mcore.config import ConfigError, dump_config, load_config
from tests.test_config import FLOAT_KEYS, _hf_dir

WRITTEN = ["1e-5", "5E-6", "1.5e+3", "1.5e3", ".5", "-2e-3", "+3E2", "7", "0.25"]


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A valid run file over two local checkpoints (config.json only), as in test_config.py."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tree = {"model": {"student": _hf_dir(tmp_path, "student")},
            "loss": {"support": "teacher"},
            "teacher": {"teachers": [{"backend": "vllm", "model": _hf_dir(tmp_path, "teacher"), "top_k": 8}]},
            "run": {"output_dir": str(tmp_path / "run")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def _with(path: str, key: str, text: str) -> str:
    """A copy of the run file at `path` with `key` set to `text` exactly as a user types it in YAML."""
    with open(path) as f:
        tree = yaml.safe_load(f)
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[leaf] = "VALUE_AS_TYPED"
    out = f"{path[:-len('.yaml')]}-{key}.yaml"
    with open(out, "w") as f:
        f.write(yaml.safe_dump(tree).replace("VALUE_AS_TYPED", text))
    return out


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[int(part)] if isinstance(cfg, list) else getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("text", WRITTEN)
def test_lr_as_written_in_a_file_and_an_override(base, text):
    assert load_config(_with(base, "optim.lr", text), validate=False).optim.lr == float(text)
    assert load_config(base, [f"optim.lr={text}"], validate=False).optim.lr == float(text)


def test_the_issue_example_validates_and_round_trips(base, tmp_path):
    cfg = load_config(_with(base, "optim.lr", "1e-5"), ["optim.min_lr=1E-7", "optim.adam_eps=1e-8"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.adam_eps) == (1e-5, 1e-7, 1e-8)
    dump_config(cfg, str(tmp_path / "resolved.yaml"))
    assert load_config(str(tmp_path / "resolved.yaml")) == cfg


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_field_takes_scientific_notation(base, key):
    assert _get(load_config(base, [f"{key}=2.5E-1"], validate=False), key) == 0.25
    assert _get(load_config(_with(base, key, "25e-2"), validate=False), key) == 0.25


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", ".inf", ".nan", "1e999", "1e-5x", "e5", "1e",
                                  "five", "1,5"])
def test_non_numbers_and_non_finite_values_stay_refused(base, text):
    with pytest.raises(ConfigError, match=r"^optim.lr: expected a (finite )?number"):
        load_config(base, [f"optim.lr={text}"], validate=False)


@pytest.mark.parametrize("text, hint", [("1e3", " (write it as the integer 1000)"),
                                        ("2.5e1", " (write it as the integer 25)"),
                                        ("1000.0", " (write it as the integer 1000)"),
                                        ("2.5", ""), ("1.5e0", ""), ("ten", "")])
def test_integer_fields_take_integers_only(base, text, hint):
    for source in (lambda: load_config(_with(base, "run.steps", text)),
                   lambda: load_config(base, [f"run.steps={text}"])):
        with pytest.raises(ConfigError) as err:
            source()
        assert str(err.value).startswith("run.steps: expected an integer, got ")
        assert str(err.value).endswith(hint) and (hint or "write it" not in str(err.value))
    assert load_config(base, ["run.steps=1000"]).run.steps == 1000


# ---- the LR schedule covers the run -------------------------------------------------------------------

@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_a_decay_shorter_than_the_run_is_refused_naming_both_keys(base, style):
    with pytest.raises(ConfigError) as err:
        load_config(base, [f"optim.lr_decay_style={style}", "optim.lr_decay_steps=6", "run.steps=10"])
    msg = str(err.value)
    assert msg.startswith(f"optim.lr_decay_steps: the {style} decay reaches optim.min_lr = 0.0 after 6 "
                          "steps, "
                          "but run.steps = 10: the last 4 steps would train at min_lr"), msg


@pytest.mark.parametrize("overrides", [
    ["optim.lr_decay_style=cosine", "optim.lr_decay_steps=10", "run.steps=10"],   # ends with the run
    ["optim.lr_decay_style=cosine", "optim.lr_decay_steps=12", "run.steps=10"],   # longer than the run
    ["optim.lr_decay_style=cosine", "run.steps=10"],                             # unset: run.steps
    ["optim.lr_decay_style=constant", "optim.lr_decay_steps=6", "run.steps=10"],  # no decay at all
])
def test_a_decay_that_covers_the_run_is_accepted(base, overrides):
    load_config(base, overrides)
