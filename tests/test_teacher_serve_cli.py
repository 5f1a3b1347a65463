"""`opkd teacher-serve`: the vLLM command it runs (flags checked without starting a server)."""
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
