"""Reading prompt files and checking their rows, every bad row named before any engine starts.

A row is located the way a user finds it again: `path:LINE` in a `.jsonl` file (1-based, as an
editor numbers lines), `path: record I` in a `.json` list (0-based, `json.load(f)[I]`) and
`path: row I` in a `.parquet` file (0-based, `table.slice(I, 1)`). Every problem reads
`<key>: <location>: field "<name>": expected ..., got ...`; all of them are collected and the first
`MAX_REPORTED` are reported with the count of the rest.

What a row must be:
* an object with a text prompt (`prompt_key`, a string) or chat messages (`messages_key`);
* messages: a non-empty list of objects, each with `role` in `CHAT_ROLES` and `content` a string
  (text-only: no content parts), at least one of them a user turn (the record's text for routing
  and rewards when it has no prompt field);
* answer (optional): a string, or an integer (stands for its decimal text, e.g. 42 -> "42"); other
  numbers are refused, since their text is ambiguous (1e-05 vs 0.00001): write the string the
  model should produce;
* data_source (optional): a string.
A null value stands for an absent field (as a null in a parquet column does): `{"prompt": null,
"messages": [...]}` is a chat row, `{"prompt": null}` alone has no prompt. Other fields are kept
as they are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from opkd_mcore.config.errors import ConfigError

MAX_REPORTED = 10  # problems spelled out in one error; the rest are counted
CHAT_ROLES = ("system", "user", "assistant", "tool")


class DataError(ConfigError):
    """Bad rows (or bad prompts) of a data file: one line per problem, `<key>: <location>: ...`."""

    def __init__(self, problems: list[str], key: str | None = None, hint: str | None = None):
        self.problems, self.key = list(problems), key
        prefix = f"{key}: " if key else ""
        lines = [prefix + p for p in self.problems[:MAX_REPORTED]]
        if len(self.problems) > MAX_REPORTED:
            lines.append(f"{prefix}... and {len(self.problems) - MAX_REPORTED} more "
                         f"({len(self.problems)} problems in all)")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


@dataclass
class Rows:
    """What a file holds: its rows (any JSON value), where each one is, and what could not be read."""

    rows: list = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read_rows(path: str) -> Rows:
    """Rows of a `.jsonl` / `.json` (a list) / `.parquet` file with their locations; unreadable lines
    are problems, not exceptions, so that one error can name all of them."""
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(".json"):
        return _read_json(path)
    return _read_jsonl(path)


def _read_jsonl(path: str) -> Rows:
    out = Rows()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                out.problems.append(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})")
                continue
            if not text.strip():
                continue
            try:  # the line alone, without its newline: an error's column is then the line's
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                out.problems.append(f"{where}: invalid JSON: {err.msg} (column {err.colno})")
                continue
            out.rows.append(row)
            out.locations.append(where)
    return out


def _read_json(path: str) -> Rows:
    try:
        with open(path, encoding="utf-8-sig") as f:
            rows = json.load(f)
    except UnicodeDecodeError as err:
        return Rows(problems=[f"{path}: not UTF-8 text ({err.reason} at byte {err.start})"])
    except json.JSONDecodeError as err:
        return Rows(problems=[f"{path}:{err.lineno}: invalid JSON: {err.msg} (column {err.colno})"])
    if not isinstance(rows, list):
        return Rows(problems=[f"{path}: expected a JSON list of objects, got {describe(rows)} "
                              "(one object per line is a .jsonl file)"])
    return Rows(rows=rows, locations=[f"{path}: record {i}" for i in range(len(rows))])


def _read_parquet(path: str) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pyarrow ships with vllm/ray; say so when it is missing
        raise ConfigError(f"{path}: reading parquet needs pyarrow") from err
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow's own error types: a broken file is a user's input error
        return Rows(problems=[f"{path}: cannot read as parquet ({type(err).__name__}: {err})"])
    # a column missing from a row is a null in parquet: drop nulls, as a JSON row would omit them
    rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    return Rows(rows=rows, locations=[f"{path}: row {i}" for i in range(len(rows))])


def describe(value) -> str:
    """A value's JSON kind for an error message, with a short excerpt of scalars."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        excerpt = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({excerpt!r})"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


@dataclass(frozen=True)
class RowKeys:
    """The columns a prompt row is read through (the `data` section's `*_key` options)."""

    prompt: str = "prompt"
    answer: str = "answer"
    data_source: str = "data_source"
    messages: str = "messages"


def row_problems(row, keys: RowKeys) -> list[str]:
    """What is wrong with one row, as `field "name": expected ..., got ...` phrases; [] when none."""
    if not isinstance(row, dict):
        return [f"expected an object with a {keys.prompt!r} or {keys.messages!r} field, got {describe(row)}"]
    prompt, messages = row.get(keys.prompt), row.get(keys.messages)
    out = []
    if prompt is None and messages is None:
        if keys.prompt in row:
            out.append(f'field "{keys.prompt}": expected a string, got null')
        elif keys.messages in row:
            out.append(f'field "{keys.messages}": expected a non-empty list of messages, got null')
        else:
            out.append(f'has neither a prompt field "{keys.prompt}" nor chat messages "{keys.messages}" '
                       f"(fields: {sorted(row)})")
    if prompt is not None and not isinstance(prompt, str):
        out.append(f'field "{keys.prompt}": expected a string, got {describe(prompt)}')
    if messages is not None:
        out += message_problems(messages, keys.messages)
    answer = row.get(keys.answer)
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int))):
        out.append(f'field "{keys.answer}": expected a string (or an integer), got {describe(answer)}')
    source = row.get(keys.data_source)
    if source is not None and not isinstance(source, str):
        out.append(f'field "{keys.data_source}": expected a string, got {describe(source)}')
    return out


def message_problems(messages, name: str) -> list[str]:
    """What is wrong with a chat-messages value of field `name`, one phrase per problem."""
    if not isinstance(messages, list) or not messages:
        return [f'field "{name}": expected a non-empty list of {{"role", "content"}} objects, '
                f"got {describe(messages)}"]
    out = []
    for j, m in enumerate(messages):
        where = f'field "{name}[{j}]'
        if not isinstance(m, dict):
            out.append(f'{where}": expected a {{"role", "content"}} object, got {describe(m)}')
            continue
        if m.get("role") not in CHAT_ROLES:
            out.append(f'{where}.role": expected one of {list(CHAT_ROLES)}, got {describe(m.get("role"))}')
        if not isinstance(m.get("content"), str):
            out.append(f'{where}.content": expected a string, got {describe(m.get("content"))}')
    if not out and not any(m["role"] == "user" for m in messages):
        out.append(f'field "{name}": expected at least one "user" message, got roles '
                   f"{[m['role'] for m in messages]}")
    return out
