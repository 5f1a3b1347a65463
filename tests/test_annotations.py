"""Every annotation in opkd_mcore names something that exists.

Annotations are strings (`from __future__ import annotations`), and names imported only for them
sit under `if TYPE_CHECKING:`; nothing evaluates either at run time, so a renamed or moved class
would leave a dangling name silently. This resolves each one, with the module's TYPE_CHECKING
imports executed."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import typing

import opkd_mcore


def _namespace(module) -> dict:
    """The module's globals plus the names its `if TYPE_CHECKING:` blocks import."""
    namespace = dict(vars(module))
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exec(compile(ast.Module(body=node.body, type_ignores=[]), module.__file__, "exec"), namespace)
    return namespace


def _unresolved(module) -> list[str]:
    try:
        namespace, found = _namespace(module), []
    except ImportError as err:
        return [f"{module.__name__}: its TYPE_CHECKING imports: {err!r}"]
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # imported from elsewhere: checked in its own module
        functions = [obj] if inspect.isfunction(obj) else []
        if inspect.isclass(obj):
            # methods written in the module (a dataclass's generated __init__ repeats its fields)
            functions = [f for f in vars(obj).values()
                         if inspect.isfunction(f) and f.__code__.co_filename == module.__file__]
            # the class's own fields only: its bases (torch.nn.Module...) resolve in their modules
            for field, text in vars(obj).get("__annotations__", {}).items():
                try:
                    if isinstance(text, str):
                        eval(text, namespace, dict(vars(obj)))
                except Exception as err:  # noqa: BLE001 - any failure is the finding
                    found.append(f"{module.__name__}.{name}.{field}: {text!r}: {err!r}")
        for fn in functions:
            try:
                typing.get_type_hints(fn, globalns=namespace)
            except Exception as err:  # noqa: BLE001
                found.append(f"{module.__name__}.{fn.__qualname__}: {err!r}")
    return found


def test_every_annotation_resolves():
    found = []
    for info in pkgutil.walk_packages(opkd_mcore.__path__, "opkd_mcore."):
        found += _unresolved(importlib.import_module(info.name))
    assert not found, "annotations naming nothing:\n" + "\n".join(found)


PROBE = """from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opkd_mcore.train.stages import ShardLayout


@dataclass
class Probe:
    shard: ShardLayout
    engine: NoSuchEngine


def use(run: Probe, sync: RenamedSyncer) -> None:
    pass
"""


def test_a_dangling_annotation_is_found(tmp_path, monkeypatch):
    (tmp_path / "annotation_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = _unresolved(importlib.import_module("annotation_probe"))
    where = [f.split(":")[0] for f in found]
    assert where == ["annotation_probe.Probe.engine", "annotation_probe.use"], found
    assert "NoSuchEngine" in found[0] and "RenamedSyncer" in found[1]  # ShardLayout came from TYPE_CHECKING
