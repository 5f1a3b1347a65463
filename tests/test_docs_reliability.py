"""docs/reliability.md names only tests that exist: every `tests/FILE.py::NAME` it cites is a test
function of that file (a parametrized test by its function name), and every row of its table cites
one. Read from the source with `ast`, nothing imported or run."""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reliability.md")
REFERENCE = re.compile(r"tests/([\w/]+\.py)::(\w+)")
# the page's one table: | what goes wrong | what the user sees | lost | tried by |
COLUMNS = 4


def defined_tests(path: str) -> set[str]:
    """Names of the test functions defined anywhere in the file at `path` (classes included)."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def dangling(text: str, root: str = ROOT) -> list[str]:
    """The references in `text` that name no test: `file::name (why)`."""
    found, cache = [], {}
    for file, name in REFERENCE.findall(text):
        path = os.path.join(root, "tests", file)
        if path not in cache:
            cache[path] = defined_tests(path) if os.path.isfile(path) else None
        if cache[path] is None:
            found.append(f"tests/{file}::{name} (no such file)")
        elif name not in cache[path]:
            found.append(f"tests/{file}::{name} (no such test in the file)")
    return found


def table_rows(text: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of every row of the page's table that describes a fault: the header,
    the separator and the group headings (a bold first cell, the others empty) left out."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip()[1:-1].split("|")]
        if cells[0] == "what goes wrong" or set(line) <= set("|- "):
            continue
        if cells[0].startswith("**") and not any(cells[1:]):
            continue
        rows.append((number, cells))
    return rows


def _page() -> str:
    with open(PAGE) as f:
        return f.read()


def test_every_cited_test_exists():
    text = _page()
    assert len(REFERENCE.findall(text)) >= 100, "the page cites fewer tests than it did when written"
    assert not dangling(text), dangling(text)


def test_every_row_has_its_four_cells_and_cites_a_test():
    rows = table_rows(_page())
    assert len(rows) >= 100, len(rows)
    wrong = [f"docs/reliability.md:{n}: {len(cells)} cells" for n, cells in rows if len(cells) != COLUMNS]
    assert not wrong, wrong
    uncited = [f"docs/reliability.md:{n}" for n, cells in rows if not REFERENCE.search(cells[-1])]
    assert not uncited, f"rows whose last cell names no test: {uncited}"


def test_a_dangling_reference_is_found(tmp_path):
    """The check can fail: a renamed test, a missing file, and a helper that is not a test."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('a', [1])\ndef test_real(a):\n    assert a\n\n"
        "def helper():\n    pass\n\nclass TestGroup:\n    def test_method(self):\n        pass\n")
    text = ("| a | b | c | `tests/test_x.py::test_real` |\n| a | b | c | `tests/test_x.py::test_renamed` |\n"
            "`tests/test_gone.py::test_real`, `tests/test_x.py::helper`, `tests/test_x.py::test_method`")
    assert dangling(text, str(tmp_path)) == ["tests/test_x.py::test_renamed (no such test in the file)",
                                             "tests/test_gone.py::test_real (no such file)",
                                             "tests/test_x.py::helper (no such test in the file)"]


def test_group_headings_and_the_header_are_not_rows():
    text = ("| what goes wrong | what the user sees | lost | tried by |\n| --- | --- | --- | --- |\n"
            "| **Data files** | | | |\n| a bad row | an error | nothing | `tests/test_x.py::test_real` |\n")
    assert table_rows(text) == [(4, ["a bad row", "an error", "nothing", "`tests/test_x.py::test_real`"])]
