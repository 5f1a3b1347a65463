"""The package layout of DESIGN.md, read from the source: packages depend downward only, the
project's own modules are imported at the top of each file, and device or backend names stay in
`platform/`."""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "opkd_mcore")
OWN = ("opkd_mcore", "opkd_kernels")
DEVICE_NAMES = re.compile(r"\b(cuda|npu|nccl|hccl)\b", re.IGNORECASE)


def _sources():
    for here, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(here, name)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), f.read()


def _part(module: str) -> str:
    """The part of the trainer a module belongs to: its package under opkd_mcore, or the
    top-level module itself (cli, launch)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _own_imports(tree: ast.AST):
    """(import node, module name) of every import of the project's own modules, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "opkd_mcore" else [f"opkd_mcore.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in OWN:
                yield node, name


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for rel, text in _sources():
        source = _part(rel[:-3].replace(os.sep, ".").removesuffix(".__init__"))
        for _, name in _own_imports(ast.parse(text)):
            if name.startswith("opkd_mcore."):
                target = _part(name)
                if target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_find_cycle_sees_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_packages_depend_downward_only():
    graph = _package_graph()
    cycle = _find_cycle(graph)
    assert cycle is None, f"import cycle between packages of opkd_mcore: {' -> '.join(cycle)}"
    # the base of the stack imports nothing else of the trainer
    assert graph.get("platform", set()) == set(), graph.get("platform")
    assert graph.get("config", set()) <= {"platform"}, graph.get("config")


def test_own_modules_are_imported_at_the_top():
    """Lazy imports are kept for the heavy optional libraries (megatron, vllm, ray, transformers);
    the project's own modules are imported at module level, so the dependency graph is visible."""
    inside = []
    for rel, text in _sources():
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [f"{rel}:{node.lineno} {name}" for node, name in _own_imports(fn)]
    assert not inside, "project imports inside functions:\n" + "\n".join(inside)


def _code_lines(text: str):
    """(line number, code) without comments and docstrings (which may say what a name means)."""
    tree = ast.parse(text)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    for number, line in enumerate(text.splitlines(), 1):
        if number not in docs:
            yield number, line.split("#", 1)[0]


def test_device_and_backend_names_only_in_platform():
    found = []
    for rel, text in _sources():
        if rel.startswith(os.path.join("opkd_mcore", "platform") + os.sep):
            continue
        found += [f"{rel}:{n}: {code.strip()}" for n, code in _code_lines(text) if DEVICE_NAMES.search(code)]
    assert not found, "device or backend names outside opkd_mcore/platform/:\n" + "\n".join(found)
