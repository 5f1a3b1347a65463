#!/usr/bin/env bash
# Here (not on the GPU machine): the wheels `tools/gpu/env.sh` installs there, into .whl/ (ignored by
# git; carried with the device tool). megatron-core and the imports of vLLM's OpenAI server that the
# vLLM bundle (../shared/device/vllm-bundle.sh) does not pack. Python 3.12, x86_64.
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    megatron-core==0.16.1 uvicorn==0.54.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 \
    python-multipart==0.0.34
ls .whl
