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
#   bash tools/gpu/wheels.sh peers  # .whl-peers/a, b, c: TRL and verl with the imports the machine lacks,
#                                   # for `opkd bench peers` (never imported by the trainer); a: TRL,
#                                   # datasets, accelerate, pandas; b: pyarrow (45 MB alone); c: verl, Hydra,
#                                   # tensordict, TransferQueue. verl also needs Ray (`wheels.sh ray`).
#
# With Ray, five back-to-back device calls: carry p0, p1 (vLLM parts), .whl-ray/a, .whl-ray/b (each:
# `bash tools/gpu/env.sh stash DIR`), then p2 + .whl with `eval "$(bash tools/gpu/env.sh)"`.
set -euo pipefail
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
if [ "${1:-}" = peers ]; then  # pure-Python wheels except xxhash, psutil, pandas, pyarrow, tensordict, orjson
  rm -rf .whl-peers && mkdir -p .whl-peers/a .whl-peers/b .whl-peers/c
  python3 -m pip download -q "${PLAT[@]}" -d .whl-peers/a trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 \
      dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 pandas==3.1.1 \
      python-dateutil==2.9.0.post0 six==1.17.0 psutil==7.2.2
  python3 -m pip download -q "${PLAT[@]}" -d .whl-peers/b pyarrow==26.0.1
  # Hydra 1.3 pins antlr4 4.9.*, published as a source archive only: built into a pure-Python wheel here
  python3 -m pip wheel -q --no-deps -w .whl-peers/c antlr4-python3-runtime==4.9.3
  python3 -m pip download -q "${PLAT[@]}" -d .whl-peers/c verl==0.9.1 hydra-core==1.3.8 omegaconf==2.3.0 \
      tensordict==0.10.0 pyvers==0.1.0 cloudpickle==3.1.2 orjson==3.13.0 \
      importlib-metadata==8.7.0 zipp==3.23.0 codetiming==1.4.0 transferqueue==0.1.11 prometheus-client==0.23.1 \
      torchdata==0.11.0 peft==0.21.2 pylatexenc==2.11
  du -sh .whl-peers/*
  exit 0
fi
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
