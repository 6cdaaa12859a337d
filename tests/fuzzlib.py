"""The fuzz suite's tools (not a test file): mutations of a valid file and the check every example must pass.

A mutation starts from a file opd wrote or accepts and breaks it the way files break: at the byte level (bit flips,
cut short, bytes inserted or deleted, another encoding) or, for JSON / YAML / JSONL, in its structure (a key removed
or added, a value replaced by one of another type or out of range, the root replaced). `outcome` runs the CLI (or a
loader) on it: each example must end in success or in one line `opd: error: ...` (exit 2, OpdError) with no
traceback, and a failure must leave the folder as it was.

Examples per kind: `OPD_FUZZ=full` runs 500 (`pytest -m fuzz`, the fuzz run), `OPD_FUZZ=<n>` n, default 20 (the small
profile inside `make test`).
"""
import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from opd.io.errors import OpdError

_level = os.environ.get("OPD_FUZZ", "")
EXAMPLES = 500 if _level == "full" else int(_level) if _level.isdigit() else 20
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=_level != "full", database=None,
                suppress_health_check=list(HealthCheck))

# values of every JSON type, including the ones that break naive readers
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2 ** 63, max_value=2 ** 80),
    st.integers(min_value=-5, max_value=5), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "nan", "1e309", "-1", "0", "true", "\x00", "é", "\ud7ff"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=6)


def _paths(tree, prefix=()):
    """Every path to a node of a JSON tree (the root included)."""
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, prefix + (i,))


def _replace(tree, path, fn):
    if not path:
        return fn(tree)
    out = dict(tree) if isinstance(tree, dict) else list(tree)
    out[path[0]] = _replace(tree[path[0]], path[1:], fn)
    return out


@st.composite
def mutated_tree(draw, tree):
    """tree with one structural change: a node replaced, a key removed or added, an item removed."""
    paths = list(_paths(tree))
    path = draw(st.sampled_from(paths))
    action = draw(st.sampled_from(["replace", "remove", "add", "replace"]))
    if action == "remove" and path:
        parent, last = path[:-1], path[-1]
        return _replace(tree, parent, lambda node: {k: v for k, v in node.items() if k != last}
                        if isinstance(node, dict) else [v for i, v in enumerate(node) if i != last])
    if action == "add":
        key, value = draw(st.text(max_size=8)), draw(json_values)
        return _replace(tree, path, lambda node: {**node, key: value} if isinstance(node, dict)
                        else node + [value] if isinstance(node, list) else value)
    return _replace(tree, path, lambda node: draw(json_values))


@st.composite
def mutated_bytes(draw, data: bytes):
    """data with one byte-level change."""
    action = draw(st.sampled_from(["flip", "cut", "insert", "delete", "encoding", "empty"]))
    n = len(data)
    if action == "empty" or n == 0:
        return b""
    i = draw(st.integers(0, n - 1))
    if action == "flip":
        return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:]
    if action == "cut":
        return data[:i]
    if action == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
    if action == "delete":
        return data[:i] + data[min(n, i + draw(st.integers(1, 8))):]
    encoding = draw(st.sampled_from(["utf-16", "latin-1", "cp1252"]))
    return data.decode("utf-8", errors="replace").encode(encoding, errors="replace")


def dump(tree, kind: str) -> bytes:
    if kind == "yaml":
        return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True).encode("utf-8", "surrogatepass")
    return json.dumps(tree, indent=1, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def mutated_file(draw, data: bytes, kind: str):
    """A mutation of a valid file's bytes. kind: json, yaml, jsonl (structural and byte-level) or bytes."""
    if kind == "bytes" or draw(st.booleans()):
        return draw(mutated_bytes(data))
    if kind == "jsonl":
        lines = data.decode().splitlines()
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = json.dumps(draw(mutated_tree(json.loads(lines[i]))), ensure_ascii=False)
        return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    tree = json.loads(data) if kind == "json" else yaml.safe_load(data)
    return dump(draw(mutated_tree(tree)), kind)


def snapshot(folder: Path) -> dict:
    """Every file under folder -> its SHA-256 (folders -> None): what 'unchanged' is checked against."""
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return out


def outcome(fn, folder: Path | None = None) -> str:
    """Run fn (a loader, or `lambda: cli.main([...])`): "ok" when it succeeds, else its one error line, after checking
    that the failure was a clean one (an OpdError or exit 2 with exactly one `opd: error:` line and no traceback) and
    that `folder` is unchanged. Anything else fails the example: an exception escaping is a traceback to a user."""
    before = snapshot(folder) if folder is not None else None
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = fn()
        except OpdError as e:
            status, line = 2, f"opd: error: {e}"
        else:
            line = None
    text = err.getvalue()
    assert "Traceback" not in text, text
    if status in (None, 0, 1, 3) and line is None:
        return "ok"
    assert status == 2, (status, text)
    errors = [ln for ln in (text.splitlines() if line is None else [line]) if ln.startswith("opd: error:")]
    assert len(errors) == 1 and "\n" not in errors[0], text
    if folder is not None:
        assert snapshot(folder) == before, f"a failure changed {folder}: {errors[0]}"
    return errors[0]
