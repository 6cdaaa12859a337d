"""The house's shape, held: opd's modules import one another without a circle, counting the imports inside functions
(so none of them can be dodging one), and each package imports only from the packages below it (LAYERS, docs/files.md
from the bottom up)."""
import ast
import functools
import re
from pathlib import Path

import opd

ROOT = Path(opd.__file__).parent
# bottom to top; "opd" is the package's face (the Python API), which only the CLI stands above
LAYERS = ["io", "models", "numerics", "engines", "data", "config", "health", "training", "admission", "study", "opd",
          "cli"]


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict) -> set[str]:
    """The opd modules a file imports anywhere in it (top level, functions, `if TYPE_CHECKING:`)."""
    return imports_of(ast.parse(path.read_text()), known)


def imports_of(tree: ast.AST, known: dict) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("opd.") or name == "opd":
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name, "opd"} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "opd"


def test_no_module_imports_in_a_circle():
    assert cycles(graph()) == []


def test_every_module_sits_in_a_layer_and_imports_only_its_own_or_lower_ones():
    edges = graph()
    assert {layer(m) for m in edges} == set(LAYERS)
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [(a, b) for a, targets in edges.items() for b in targets if rank[layer(b)] > rank[layer(a)]]
    assert upward == []


def test_the_circle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_files_page_lists_every_module_once_under_its_package():
    files = (ROOT.parent / "docs" / "files.md").read_text()  # the README's Files section points there
    listed, package = [], None
    for line in files.splitlines():
        if m := re.match(r"^([a-z_]+)/\s{2,}\S", line):
            package = m.group(1)
        elif (m := re.match(r"^  ([a-z_]+)\s{2,}\S", line)) and package:
            listed.append(f"opd.{package}.{m.group(1)}")
    assert sorted(listed) == sorted(m for m in modules() if m.count(".") == 2 and not m.endswith("__main__"))


def test_the_longest_chain_of_module_level_imports_is_at_most_13():
    """Module-level imports (those inside functions load lazily): a chain of modules each importing the next. Issue 37
    held it at 10 while imports inside functions that dodged circles were not counted; with those at the top (none
    dodges a circle now) it is 13: cli -> study -> admission -> training (setup, worker, learner, chunked, losses) ->
    config -> data -> io."""
    known, edges = modules(), {}
    for name, path in known.items():
        top = ast.Module(body=[n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))],
                         type_ignores=[])
        edges[name] = imports_of(top, known) - {name, "opd"}

    @functools.lru_cache(None)
    def chain(name: str) -> tuple[str, ...]:
        return max(((name,) + chain(d) for d in edges[name]), key=len, default=(name,))
    longest = max((chain(m) for m in known), key=len)
    assert len(longest) <= 13, " -> ".join(longest)
