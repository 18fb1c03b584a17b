"""The layout: folders are layers that import only the ones above them, with no import circle,
torch only under runtime/, no command module importing another, and no module over ~400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import balancer_cli

PACKAGE = Path(balancer_cli.__file__).parent
#: Top-level modules and folders, from the bottom layer up (the order of docs/architecture.md).
LAYERS = (
    ("errors", "_jit", "_sort", "_index", "_columns", "_shuffle", "_arrow", "_fsutil", "_memory", "_procs", "_signals",
     "_reaper", "_ray", "commit"),
    ("omnibal_json", "lengths", "manifest_meta", "manifest", "metrics"),
    ("scan",),
    ("cost",),
    ("replay",),
    ("pack",),
    ("report",),
    ("planners",),
    ("run",),
    ("runtime",),
    ("cli", "__main__"),
)
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in names:
            while target.startswith("balancer_cli") and target not in modules:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                targets.add(target)
    return targets


def _graph():
    modules = _modules()
    return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def _top(name: str) -> str:
    return name.split(".")[1] if "." in name else "__init__"


def test_every_top_level_part_has_a_layer():
    assert {_top(name) for name in _modules()} - {"__init__"} == set(LAYER)


def test_imports_point_only_at_lower_layers():
    _, graph = _graph()
    upward = [f"{a} imports {b}" for a, targets in graph.items() for b in targets
              if _top(a) != "__init__" and _top(b) != "__init__" and LAYER[_top(b)] > LAYER[_top(a)]]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circle_between_modules():
    _, graph = _graph()
    # package __init__ modules may re-export their own children; ignore parent -> child edges
    edges = {a: {b for b in targets if not b.startswith(a + ".")} for a, targets in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join(path[path.index(nxt):] + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_torch_only_under_runtime_and_commands_stand_alone():
    modules, graph = _graph()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        uses_torch = any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch" and not n.level)
            for n in ast.walk(tree))
        assert not uses_torch or _top(name) == "runtime", f"{name} imports torch outside runtime/"
        if ".cli.cmd_" in name:
            assert not [t for t in graph[name] if ".cli.cmd_" in t], f"{name} imports another command module"


def test_modules_stay_small():
    big = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
