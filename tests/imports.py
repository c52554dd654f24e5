"""The repository's imports, read from its source: the graph the layout tests check and the docs
draw (``package_graph``, ``mermaid``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fp4prep", "registry", "jobs")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path) -> set[str]:
    """Every module ``name`` (at ``path``) imports, at module level or inside a function, with
    relative imports resolved; ``from a import b`` counts as importing ``a`` and ``a.b``."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Every import, at module level or inside a function, between this project's modules.

    A module's own ancestor packages are left out: Python initializes them first, whatever the
    module imports.
    """
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = imports_of(name, path)
        graph[name] = {t for t in targets if t in known and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def package_of(module: str) -> str:
    """The package a module belongs to in the drawing: the pipeline's subpackages, ``fp4prep``'s
    other subpackages, ``fp4prep``'s own modules, and each app as a whole."""
    parts = module.split(".")
    if parts[0] != "fp4prep":
        return parts[0]
    depth = 3 if parts[1:2] == ["pipeline"] else 2
    known = modules()
    package = ".".join(parts[:depth])
    while package not in known or known[package].name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    return package


def package_graph() -> dict[str, set[str]]:
    """Which package imports which (``package_of``), without a package's imports of itself."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        source = package_of(module)
        graph.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return graph


def mermaid() -> str:
    """The package graph as a Mermaid flowchart: the product (what ``pip install fp4prep`` brings a
    script) in one box, the site that serves it (the Django project and its apps) in the other."""
    graph = package_graph()
    site = {p for p in graph if p in ("registry", "jobs") or p.startswith("fp4prep.site")}
    node = {p: p.replace(".", "_") for p in graph}
    lines = ["flowchart TD"]
    for title, members in (("the product: fp4prep", sorted(set(graph) - site)), ("the site: Django", sorted(site))):
        lines.append(f'    subgraph {title.split(":")[0].split()[-1]}["{title}"]')
        lines += [f'        {node[p]}["{p}"]' for p in members]
        lines.append("    end")
    lines += [f"    {node[a]} --> {node[b]}" for a in sorted(graph) for b in sorted(graph[a])]
    return "\n".join(lines) + "\n"
