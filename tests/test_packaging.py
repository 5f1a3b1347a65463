"""A plain (non-editable) install: the wheel carries what `opkd demo` reads at run time."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_config_is_package_data_of_the_wheel(tmp_path):
    env = {**os.environ, "OPKD_SKIP_CPP": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, env=env, cwd=tmp_path, timeout=600)
    (wheel,) = [p for p in os.listdir(tmp_path / "dist") if p.endswith(".whl")]
    assert "opkd_mcore/demo/demo_cpu.yaml" in zipfile.ZipFile(tmp_path / "dist" / wheel).namelist()
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(tmp_path / "dist" / wheel)], check=True, timeout=600)
    # run from elsewhere, with the installed copy first on the path: the source tree is not used
    probe = ("import os, opkd_mcore.demo.run as d; from opkd_mcore.config import load_config; "
             "p = d.demo_config_path(); print(p); "
             "assert load_config(p, validate=False).teacher.teachers[0].top_k == 8")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(site)},
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(site))
