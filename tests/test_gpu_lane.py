"""The GPU lane's split steps (tools/gpu/lane.sh tests_x4 / tests_x2) must select, together, every test
of the whole GPU suite (`lane.sh tests`): a test left out of every part never runs on a GPU.

This checks the runbook of the lent GPU machine, not the product: it is not in the default run
(`pytest -m runbook` runs it, ~45 s; tools/gpu/README.md)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.runbook, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"tests_x4": "abcde", "tests_x2": "abcdefghijk"}


def _collected(out: Path, *step: str) -> set[str]:
    env = {**os.environ, "COLLECT_ONLY": "1", "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "tools/gpu/lane.sh", *step], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    ids = set()
    for log in out.rglob("tests.log"):
        text = log.read_text()
        assert " collected" in text, f"{log}: no collection\n{text[-2000:]}"
        ids |= {line for line in text.splitlines() if line.startswith("tests/") and "::" in line}
    return ids


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> tuple[set[str], set[str]]:
    """The whole GPU suite and the 4-rank part, collected once for every layout."""
    out = tmp_path_factory.mktemp("lane")
    return _collected(out / "whole", "tests"), _collected(out / "quad", "tests_quad")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_split_steps_select_the_whole_gpu_suite(layout, suite, tmp_path):
    whole, quad = suite
    assert len(whole) > 100, sorted(whole)[:5]
    parts = set(quad)
    for step in LAYOUTS[layout]:
        parts |= _collected(tmp_path / step, layout, step)
    assert whole - parts == set(), f"{layout} never runs these"
    assert parts <= whole
