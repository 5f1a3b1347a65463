"""opkd-mcore: on-policy knowledge distillation on Megatron-core.

`kernels/` is installed as `opkd_kernels` (a top-level `kernels` package already exists on
the package index). The C++ CPU twin of the fused loss in `csrc/` is optional: if it cannot be
built, everything runs through the torch reference path.
"""
import glob
import os
import platform

from setuptools import find_packages, setup


def _cpu_extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources or os.environ.get("OPKD_SKIP_CPP") == "1":
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # torch not installed in the build environment
        return {}
    # The row loops (exp polynomial, floor, blends) vectorise only with -fno-trapping-math (GCC
    # will not if-convert FP selects otherwise) and SSE4.1+ (-march=native: the extension is built
    # on the machine that runs it, scripts/install.sh; OPKD_CPP_PORTABLE=1 for binaries that travel).
    arch = [] if os.environ.get("OPKD_CPP_PORTABLE") == "1" else ["-march=native"]
    if arch and platform.machine().lower() in ("x86_64", "amd64"):
        # GCC picks 256-bit vectors by default even with AVX-512; 512 made the row loops 1.2-2x
        # faster on the CI CPU (a tuning hint: no effect on a CPU without AVX-512)
        arch.append("-mprefer-vector-width=512")
    ext = CppExtension(
        "opkd_kernels._cpu",
        sources,
        extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math"] + arch,
        extra_link_args=["-fopenmp"],
        optional=True,
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)}}


setup(
    name="opkd-mcore",
    version="0.1.0",
    description="On-policy knowledge distillation for LLMs on Megatron-core",
    python_requires=">=3.10",
    packages=find_packages(include=["opkd_mcore", "opkd_mcore.*"]) + ["opkd_kernels"],
    package_dir={"opkd_kernels": "kernels"},
    # the demo's config is package data, so `opkd demo` runs from a plain (non-editable) install
    package_data={"opkd_mcore.demo": ["demo_cpu.yaml", "self_distill_cpu.yaml"]},
    install_requires=["torch", "numpy", "pyyaml", "safetensors", "tqdm"],
    extras_require={
        "train": ["megatron-core==0.16.1", "transformers"],
        "rollout": ["vllm"],
        "ray": ["ray"],
        "demo": ["matplotlib"],
        "gpu": ["triton", "liger-kernel"],
        "data": ["pyarrow"],
        "test": ["pytest", "pytest-timeout", "transformers", "matplotlib", "pyarrow"],
    },
    entry_points={"console_scripts": ["opkd=opkd_mcore.cli:main"]},
    **_cpu_extension(),
)
