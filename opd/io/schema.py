"""Checked reading of every file opd reads: bytes -> UTF-8 text -> JSON or YAML -> a typed schema.

Each step fails with one line (`OpdError`) that names the file, the line or key, and what was expected:
- not found, a folder, unreadable: named with the system's reason;
- not UTF-8: the byte offset;
- not JSON / YAML, nested too deep, a key given twice (JSON and YAML would silently keep the last one): the line;
- the wrong shape or type, a missing key: the key's path (`classes.full.max`), what it should be and what it is.

The schemas are pydantic models in strict mode (`Schema`): no silent conversions ("3" is not 3, 1 is not true, an
integer is accepted where a float is expected); unknown keys are kept (files written by a newer release, or by
transformers, carry keys opd does not read). pydantic rather than hand-written checks: it is the ecosystem's
validation library (vLLM and transformers' dependencies already install it), its strict mode is exactly the rule we
want, and its errors carry the location that the one-line message needs.
"""
import json
import re
import sys
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from opd.io.errors import OpdError

S = TypeVar("S", bound=BaseModel)


class Schema(BaseModel):
    """A file kind's shape: strict types, unknown keys kept."""
    model_config = ConfigDict(strict=True, extra="allow")


def read_text(path, what: str = "file") -> str:
    """The file's text. One line when it is missing, a folder, unreadable or not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise OpdError(f"{what} not found: {path}", "check the path")
    if not path.is_file():
        raise OpdError(f"{what} {path} is not a file", "give the path of a file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise OpdError(f"cannot read {what} {path}: {e.strerror or e}", "check its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpdError(f"{path} is not UTF-8 text (byte {e.start})", "save it as UTF-8") from None


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice")
        out[key] = value
    return out


def parse_json(text: str, where: str, fix: str = "fix or re-create the file") -> Any:
    """JSON text -> value; duplicate keys and nesting deeper than Python's recursion limit are errors too."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as e:
        raise OpdError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})", fix) from None
    except ValueError as e:  # a duplicate key
        raise OpdError(f"{where}: not valid JSON ({e})", fix) from None
    except RecursionError:
        raise OpdError(f"{where}: not valid JSON (nested too deep)", fix) from None


def read_json(path, what: str = "file", fix: str = "fix or re-create the file") -> Any:
    return parse_json(read_text(path, what), str(path), fix)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a mapping that gives a key twice is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark)
        return super().construct_mapping(node, deep)


# YAML 1.2's floats: PyYAML (YAML 1.1) reads `3e-4` (no dot) as a string; a quoted "3e-4" stays a string
UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_yaml(text: str, where: str, fix: str = "fix the YAML") -> Any:
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise OpdError(f"{where}: not valid YAML ({problem}{at})", fix) from None
    except RecursionError:
        raise OpdError(f"{where}: not valid YAML (nested too deep)", fix) from None


def read_yaml(path, what: str = "file", fix: str = "fix the YAML") -> Any:
    return parse_yaml(read_text(path, what), str(path), fix)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check(schema: type[S], data: Any, where: str, fix: str = "fix or re-create the file") -> S:
    """data validated as `schema`; the first problem as one line: where, the key's path, what was expected."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise OpdError(f"{where}: {problem(e)}", fix) from None


_TAG = re.compile(r"^(float|int|str|bool|none|bytes|list\[.*\]|dict\[.*\]|tuple\[.*\]|[a-z-]+\[.*\]|constrained-[a-z]+)$")


def problem(e: ValidationError) -> str:
    """A pydantic error in a few words: `key.path: expected ..., got ...` (the alternatives of a union joined)."""
    errors = e.errors(include_url=False)

    def where(err) -> tuple:  # the key path without pydantic's tags for the alternatives of a union
        return tuple(part for part in err["loc"] if not (isinstance(part, str) and _TAG.match(part)))
    first = errors[0]
    loc = ".".join(str(part) for part in where(first))
    if first["type"] == "missing":
        return f"missing key {loc!r}"
    if first["type"] == "extra_forbidden":
        return f"unexpected key {loc!r}"
    if first["type"] == "too_short":
        return f"{loc + ': ' if loc else ''}must not be empty"
    wanted = []
    for err in errors:
        if where(err) == where(first):
            message = err["msg"].replace("Input should be ", "").replace("Value error, ", "")
            if message not in wanted:
                wanted.append(message)
    return f"{loc + ': ' if loc else ''}expected {' or '.join(wanted)}, got {_short(first.get('input'))}"


def read_object(path, schema: type[BaseModel], fix: str = "fix or re-create the file", optional: bool = False) -> dict:
    """A JSON file holding one object, checked against schema; {} for a missing file when optional."""
    path = Path(path)
    if optional and not path.exists() and not path.is_symlink():  # absent; a folder or a device there is an error
        return {}
    data = read_json(path, path.name, fix)
    if not isinstance(data, dict):
        raise OpdError(f"{path}: expected a JSON object, got {type(data).__name__}", fix)
    check(schema, data, str(path), fix)
    return data


def read_jsonl(path, what: str, schema: type[S] | None = None, torn: str = "drop",
               fix: str = "fix or re-create the file") -> list:
    """A JSONL file's objects (validated as schema when given), one per non-empty line. A line that is not JSON:
    torn="drop": the last line is a torn write of a killed writer and is left out, any other is an error;
    torn="warn": skipped with a warning (a file several writers append to); torn="error": an error."""
    path = Path(path)
    lines = read_text(path, what).splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(numbered):
        where = f"{path}:{n}"
        try:
            value = parse_json(line, where, fix)
        except OpdError:
            if torn == "warn":
                print(f"opd: warning: {where} is not a complete JSON line; ignored", file=sys.stderr)
                continue
            if torn == "drop" and i == len(numbered) - 1:
                continue
            raise
        if not isinstance(value, dict):
            raise OpdError(f"{where}: expected a JSON object, got {type(value).__name__}", fix)
        rows.append(check(schema, value, where, fix) if schema is not None else value)
    return rows
