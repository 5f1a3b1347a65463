#!/usr/bin/env bash
# Prepare the lent GPU machine (torch + triton there; no megatron-core, vLLM or this package) and
# print the exports that make them importable. Run from the repository root, after the vLLM parts
# p0 and p1 were stashed by earlier calls (../shared/device/vllm-bundle.sh explains the carry):
#
#   bash tools/gpu/wheels.sh               # here, once: .whl/ (megatron-core, vLLM server imports)
#   bash tools/gpu/env.sh stash .whl-ray/a # there, optional (Ray): one call per half, see wheels.sh
#   eval "$(bash tools/gpu/env.sh)"        # there; carry: .vllm-parts/p2 and .whl
#
# Transformer Engine (what users of Megatron run; the layer spec switches to it when importable):
# stash .te-parts/p0 .. p3 (../shared/device/te-bundle.sh) in earlier calls, then carry .te-parts/p4
# into one call of this script (it builds TE's torch extension there, ~70 s); OPKD_NO_TE=1 leaves it
# off for a call on a machine that has it (the lane's "without TE" half).
#
# Idempotent: a later call on the same warm machine only prints the exports again.
set -euo pipefail
root=$(pwd)
if [ "${1:-}" = stash ]; then  # keep a carried half of the Ray wheels for the install call
  mkdir -p /tmp/ray-parts && cp "$2"/* /tmp/ray-parts/ && ls /tmp/ray-parts >&2
  exit 0
fi
if [ ! -f /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >&2
  touch /tmp/site/.ok
fi
if [ -f /tmp/ray-parts/ray.tar.part0 ] && [ -f /tmp/ray-parts/ray.tar.part1 ] && [ ! -f /tmp/site/.ray ]; then
  cat /tmp/ray-parts/ray.tar.part0 /tmp/ray-parts/ray.tar.part1 > /tmp/ray-parts/ray.tar
  [ "$(sha256sum /tmp/ray-parts/ray.tar | cut -d' ' -f1)" = "$(cat /tmp/ray-parts/ray.tar.sha256)" ] || \
      { echo "env.sh: the Ray halves do not reassemble (sha256 mismatch)" >&2; exit 1; }
  mkdir -p /tmp/ray-parts/whl && tar xf /tmp/ray-parts/ray.tar -C /tmp/ray-parts/whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site /tmp/ray-parts/whl/*.whl >&2
  touch /tmp/site/.ray
fi
# the Triton/C++ kernels package is `opkd_kernels`, installed from kernels/ (setup.py package_dir)
ln -sfn "$root/kernels" /tmp/site/opkd_kernels
if [ -f /tmp/vllm-site/.ok ]; then  # installed by an earlier call: the parts need not travel again
  echo "export PYTHONPATH=/tmp/vllm-site\${PYTHONPATH:+:\$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn"
elif [ -d .vllm-parts/p2 ]; then
  bash .vllm-parts/p2/vllm-bundle.sh install .vllm-parts/p2
else  # the calls that carry p0 / p1 run the work that needs no vLLM (kernels, Megatron)
  echo "env.sh: vLLM not installed yet (carry .vllm-parts/p2 after p0 and p1)" >&2
fi
if [ "${OPKD_NO_TE:-0}" != 1 ]; then
  if [ -f /tmp/te-site/.ok ]; then
    echo "export PYTHONPATH=/tmp/te-site\${PYTHONPATH:+:\$PYTHONPATH}"
  elif [ -d .te-parts/p4 ]; then
    bash .te-parts/p4/te-bundle.sh install .te-parts/p4
  fi
fi
echo "export PYTHONPATH=$root:/tmp/site:\${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1"\
     "NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false"
