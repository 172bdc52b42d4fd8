"""The house's import graph, read from the source as pip installs it (pyproject's package-dir maps server/,
workers/, cli/, trials/, demos/ and bench/ to ckpt_engine.<folder>): no circle between files or folders, and
every room imports only the rooms below it (docs/architecture.md). Type-only and lazy imports count too: a
circle hidden in a function or behind TYPE_CHECKING is still one a reader must hold in mind."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]

# Each room and the rooms it may import ("library": the files under ckpt_engine/ itself).
ALLOWED = {
    "library": set(),
    "server": {"library"},
    "workers": {"library"},
    "demos": {"library", "server", "workers"},
    "trials": {"library", "server", "workers"},
    "bench": {"library", "server", "workers", "demos"},
    "cli": {"library", "server", "workers", "demos", "trials", "bench"},
}


def package_dirs() -> dict[str, Path]:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: REPO / folder for package, folder in tool["package-dir"].items()}


def modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, the most specific mapping winning (ckpt_engine/ holds no server/ folder)."""
    out: dict[str, Path] = {}
    for package, folder in sorted(dirs.items(), key=lambda item: len(item[0])):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports anywhere in its file (a package import counts as its
    ``__init__``; ``from package import module`` as the module)."""

    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {nearest(alias.name) for alias in node.names if alias.name.startswith("ckpt_engine")}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if module.startswith("ckpt_engine"):
                found |= {nearest(f"{module}.{alias.name}") for alias in node.names}
    return {m for m in found if m is not None and m != name}


@functools.cache  # (one parse of the tree for every test here)
def graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    known = modules(package_dirs())
    return {name: imports_of(name, path, known) for name, path in known.items()}, known


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def folder_of(name: str, known: dict[str, Path]) -> str:
    return name if known[name].name == "__init__.py" else name.rpartition(".")[0]


def room_of(name: str) -> str:
    second = (name.split(".") + [""])[1]
    return second if second in ALLOWED else "library"


def test_the_circle_finder_finds_circles() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_module_of_the_mapping_is_seen() -> None:
    _, known = graph()
    for package in ("ckpt_engine.server.controller", "ckpt_engine.workers.agent", "ckpt_engine.cli.main",
                    "ckpt_engine.trials.chaos", "ckpt_engine.demos.fully_async", "ckpt_engine.bench.suite",
                    "ckpt_engine.send.sender", "ckpt_engine.config.deployment"):
        assert package in known


def test_no_file_imports_itself_around_a_circle() -> None:
    edges, _ = graph()
    assert circles(edges) == []


def test_no_folder_imports_itself_around_a_circle() -> None:
    edges, known = graph()
    folders: dict[str, set[str]] = {}
    for name, targets in edges.items():
        here = folder_of(name, known)
        folders.setdefault(here, set()).update(t for t in (folder_of(t, known) for t in targets) if t != here)
    assert circles(folders) == []


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_imports_only_the_rooms_below_it(room: str) -> None:
    edges, _ = graph()
    wrong = sorted(f"{name} -> {target}" for name, targets in edges.items() if room_of(name) == room
                   for target in targets if room_of(target) not in ALLOWED[room] | {room})
    assert wrong == []
