"""`opkd` command line: one subcommand per job; each job's module parses its own flags.

    opkd demo [--quick] [--out DIR]          synthetic-task distillation on CPU, end to end
    opkd train --config FILE [key=value ...]  distillation training (single process or torchrun)
    opkd teacher-serve --model DIR --k K      vLLM OpenAI server set up for top-k teacher scoring
    opkd convert hf-to-mcore|mcore-to-hf ...  checkpoint conversion (same as tools/convert_ckpt.py)
    opkd bench kernels|weight-sync|teacher|models|step|peers   benchmarks (same as tools/bench_*.py)
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys

# subcommand -> (module, function, one-line help); modules are imported only when used.
COMMANDS = {
    "demo": ("opkd_mcore.demo.run", "main", "synthetic-task on-policy distillation, CPU by default"),
    "train": ("opkd_mcore.launch", "main", "on-policy distillation training"),
    "teacher-serve": ("opkd_mcore.teacher.serve", "main", "start a vLLM server for teacher scoring"),
    "convert": ("opkd_mcore.models.convert", "main", "convert checkpoints HF <-> Megatron"),
}
BENCHMARKS = {"kernels": "bench_kernels.py", "weight-sync": "bench_weight_sync.py",
              "teacher": "bench_teacher.py", "models": "bench_models.py", "step": "bench_step.py",
              "peers": "bench_peers.py"}


def _usage() -> str:
    lines = ["usage: opkd COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<14} {doc}" for name, (_, _, doc) in COMMANDS.items()]
    lines.append(f"  {'bench':<14} benchmarks: {', '.join(BENCHMARKS)} (tools/bench_*.py)")
    return "\n".join(lines)


def _run_benchmark(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: opkd bench {{{','.join(BENCHMARKS)}}} [ARGS...]", file=sys.stderr)
        return 2
    tools_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    script = os.path.join(tools_dir, BENCHMARKS[argv[0]])
    if not os.path.exists(script):
        print(f"opkd bench {argv[0]}: {script} not found (benchmarks need a source checkout)",
              file=sys.stderr)
        return 2
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "bench":
        return _run_benchmark(rest)
    if name not in COMMANDS:
        print(f"opkd: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), func)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
