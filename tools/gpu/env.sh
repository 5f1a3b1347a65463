#!/usr/bin/env bash
# Prepare the lent GPU machine (torch + triton there; no megatron-core, vLLM or this package) and
# print the exports that make them importable. Run from the repository root, after the vLLM parts
# p0 and p1 were stashed by earlier calls (../shared/device/vllm-bundle.sh explains the carry):
#
#   bash tools/gpu/wheels.sh               # here, once: .whl/ (megatron-core, vLLM server imports)
#   eval "$(bash tools/gpu/env.sh)"        # there; carry: .vllm-parts/p2 and .whl
#
# Idempotent: a later call on the same warm machine only prints the exports again.
set -euo pipefail
root=$(pwd)
if [ ! -f /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >&2
  touch /tmp/site/.ok
fi
# the Triton/C++ kernels package is `opkd_kernels`, installed from kernels/ (setup.py package_dir)
ln -sfn "$root/kernels" /tmp/site/opkd_kernels
if [ -f /tmp/vllm-site/.ok ]; then  # installed by an earlier call: the parts need not travel again
  echo "export PYTHONPATH=/tmp/vllm-site\${PYTHONPATH:+:\$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn"
else
  bash .vllm-parts/p2/vllm-bundle.sh install .vllm-parts/p2
fi
echo "export PYTHONPATH=$root:/tmp/site:\${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1"\
     "NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false"
