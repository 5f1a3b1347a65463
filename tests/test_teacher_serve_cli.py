"""`opkd teacher-serve`: the vLLM command it runs (flags checked without starting a server), and the
two-node recipe's commands checked against the CLI and the config schema."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from opkd_mcore.teacher.serve import TeacherServerConfig, server_command


def test_dry_run_prints_a_server_command_with_prefix_caching_off_and_max_logprobs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", "teacher-serve", "--model",
                          str(tmp_path), "--k", "256", "--port", "8123", "--dry-run", "--",
                          "--max-num-seqs", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--max-logprobs") + 1] == "256"
    assert "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[-2:] == ["--max-num-seqs", "4"]


@pytest.mark.parametrize("kw, match", [
    ({"model": "/nonexistent/teacher"}, "model: expected a checkpoint directory"),
    ({"k": 0}, "k: expected >= 1"),
    ({"port": 70000}, "port: expected 1..65535"),
])
def test_bad_server_config_names_the_option(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        server_command(TeacherServerConfig(**{"model": str(tmp_path), **kw}))


def test_cli_refuses_a_bad_option_with_one_line_and_exit_2(tmp_path):
    """`opkd teacher-serve` with a model that is no checkpoint: one error line naming the option, no
    traceback, no server started."""
    out = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", "teacher-serve", "--model",
                          str(tmp_path / "missing"), "--k", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"opkd teacher-serve: error: model: expected a checkpoint directory, "
                                  f"got {str(tmp_path / 'missing')!r}")


def test_server_command_binds_the_given_host(tmp_path):
    cmd = server_command(TeacherServerConfig(model=str(tmp_path), host="0.0.0.0", port=8001))
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


# ---- the two-node recipe, as written in README.md and the recipe config's header --------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "qwen3_8b_from_32b.yaml")


def _commands(lines: list[str]) -> list[list[str]]:
    """Shell lines (comments dropped, `\\` continuations joined) -> argv lists without env assignments."""
    text = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
            argv.pop(0)
        if argv and argv[-1] == "&":
            argv.pop()
        if argv:
            out.append(argv)
    return out


def _readme_recipe() -> list[list[str]]:
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("### A real-scale recipe", 1)[1].split("\n## ", 1)[0]
    return _commands(section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines())


def _yaml_header_recipe() -> list[list[str]]:
    with open(RECIPE) as f:
        header = [line for line in f.read().split("\nmodel:", 1)[0].splitlines()]
    return _commands([line.lstrip("#").strip() for line in header if line.startswith("#     ")])


def _local(path: str, root) -> str:
    """Where an absolute path of the recipe lives in this test (its parents made)."""
    assert os.path.isabs(path), f"recipe path {path!r}: expected a local absolute path, not a hub id"
    local = os.path.join(str(root), path.lstrip("/"))
    os.makedirs(os.path.dirname(local), exist_ok=True)
    return local


def _check_teacher_serve(argv: list[str], root) -> int:
    from opkd_mcore.teacher.serve import _parser

    args = _parser().parse_args(argv)
    os.makedirs(_local(args.model, root), exist_ok=True)
    cmd = server_command(TeacherServerConfig(model=_local(args.model, root), k=args.k, host=args.host,
                                             port=args.port, tensor_parallel_size=args.tp))
    # node 0 sends the requests: a server bound to loopback on node 1 is unreachable from it
    assert cmd[cmd.index("--host") + 1] not in ("127.0.0.1", "localhost"), argv
    return args.port


def _check_train(argv: list[str], root, monkeypatch):
    from opkd_mcore.config import load_config
    from opkd_mcore.config.model_checks import KNOWN_MODEL_SHAPES
    from opkd_mcore.launch import parse_args

    args = parse_args(argv)
    overrides = []
    for item in args.overrides:
        key, value = item.split("=", 1)
        if key == "model.student":
            value = _local(value, root)
            shape = KNOWN_MODEL_SHAPES["Qwen/Qwen3-8B"]
            os.makedirs(value, exist_ok=True)
            with open(os.path.join(value, "config.json"), "w") as f:
                json.dump({"model_type": "qwen3", "num_attention_heads": shape["heads"],
                           "num_key_value_heads": shape["kv_heads"], "num_hidden_layers": shape["layers"],
                           "vocab_size": shape["vocab"]}, f)
        elif key == "data.train_path":
            value = _local(value, root)
            with open(value, "w") as f:
                f.write('{"prompt": "1+1=", "answer": "2"}\n')
        overrides.append(f"{key}={value}")
    monkeypatch.chdir(ROOT)  # the config path is relative to the checkout
    return load_config(args.config, overrides)  # check_files: what `opkd train` would refuse


@pytest.mark.parametrize("source", ["README.md", "recipe config header"])
def test_two_node_recipe_commands_match_the_cli_and_the_schema(source, tmp_path, monkeypatch):
    commands = _readme_recipe() if source == "README.md" else _yaml_header_recipe()
    serve = [c[2:] for c in commands if c[:2] == ["opkd", "teacher-serve"]]
    train = [c[c.index("train") + 1:] for c in commands if c[0] == "torchrun"]
    assert len(serve) == 2 and len(train) == 1, commands
    assert train and commands[-1][:4] == ["torchrun", "--nproc_per_node", "8", "-m"]
    ports = {_check_teacher_serve(argv, tmp_path) for argv in serve}
    cfg = _check_train(train[0], tmp_path, monkeypatch)
    teacher = cfg.teacher.teachers[0]
    urls = [teacher.url, *teacher.replica_urls]
    assert {int(u.rsplit(":", 1)[1]) for u in urls} == ports, urls  # the trainer asks the servers started
    assert cfg.parallel.world_size == 8
