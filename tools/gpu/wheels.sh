#!/usr/bin/env bash
# Here (not on the GPU machine): the wheels `tools/gpu/env.sh` installs there (ignored by git;
# carried with the device tool). Python 3.12, x86_64. Liger-Kernel and Cut Cross-Entropy are the
# baselines of `bench_kernels.py --mode lm_head`; they are benchmarked there, never imported by the trainer.
#
#   bash tools/gpu/wheels.sh        # .whl/: megatron-core, the vLLM server's imports that the vLLM
#                                   # bundle (../shared/device/vllm-bundle.sh) does not pack, and the
#                                   # LM-head benchmark's baselines
#   bash tools/gpu/wheels.sh ray    # .whl-ray/a and .whl-ray/b: Ray and its imports, split in two
#                                   # halves under the 64 MiB a device call carries (the wheel is 79 MB)
#
# With Ray, five back-to-back device calls: carry p0, p1 (vLLM parts), .whl-ray/a, .whl-ray/b (each:
# `bash tools/gpu/env.sh stash DIR`), then p2 + .whl with `eval "$(bash tools/gpu/env.sh)"`.
set -euo pipefail
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
if [ "${1:-}" = ray ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q "${PLAT[@]}" -d "$tmp" ray==2.60.0 click==8.5.1 jsonschema==4.26.0 \
      jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
      msgpack==1.2.4 protobuf==7.36.2 PyYAML==6.0.3 requests==2.34.2 urllib3==2.8.0 idna==3.20 \
      charset-normalizer==3.5.2 certifi==2026.10.18 filelock==4.2.11
  rm -rf .whl-ray && mkdir -p .whl-ray/a .whl-ray/b
  (cd "$tmp" && tar cf - ./*.whl) > "$tmp/ray.tar"
  (cd "$tmp" && sha256sum ray.tar | cut -d' ' -f1) > .whl-ray/b/ray.tar.sha256
  half=$(( ($(stat -c %s "$tmp/ray.tar") + 1) / 2 ))
  split -b "$half" -d -a 1 "$tmp/ray.tar" "$tmp/ray.tar.part"
  mv "$tmp/ray.tar.part0" .whl-ray/a/ && mv "$tmp/ray.tar.part1" .whl-ray/b/
  rm -rf "$tmp"
  du -sh .whl-ray/*
  exit 0
fi
mkdir -p .whl
python3 -m pip download -q "${PLAT[@]}" -d .whl \
    megatron-core==0.16.1 uvicorn==0.54.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 \
    python-multipart==0.0.34 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 \
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1
ls .whl
