"""The code's shape, checked: no import cycles, the registry stands below jobs and the demo, and no
module grows past 400 lines without saying why at its top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fp4prep", "registry", "jobs")
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Every import, at module level or inside a function, between this project's modules.

    A module's own ancestor packages are left out: Python initializes them first, whatever the
    module imports.
    """
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
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
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_import_graph_has_no_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50 and any(graph.values())  # the walk found the code
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_registry_imports_nothing_from_jobs_or_the_demo() -> None:
    graph = import_graph()
    for name in (m for m in graph if m.split(".")[0] == "registry"):
        below = {m for m in reachable(graph, name) if m.startswith(("jobs", "fp4prep.demo"))}
        assert not below, f"{name} reaches {sorted(below)}"


def test_no_module_is_over_400_lines_without_a_reason_at_its_top() -> None:
    long = []
    for path in [*modules().values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any("longer than 400 lines" in line for line in lines[:15]):
            long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert long == []


def test_the_readme_layout_names_every_module() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How the code is laid out", 1)[1].split("\n## ", 1)[0]
    # {a,b}.py in the tree names a.py and b.py
    named = set(re.findall(r"(\w+)\.py", section))
    for group in re.findall(r"\{([\w,]+)\}\.py", section):
        named.update(group.split(","))
    missing = [
        str(path.relative_to(ROOT))
        for path in modules().values()
        if path.name not in ("__init__.py", "apps.py", "__main__.py") and path.stem not in named
    ]
    assert missing == []


MAX_FUNCTION_LINES = 60
HEAVY = ("torch", "transformers", "modelopt", "accelerate", "peft", "safetensors")


def test_no_pipeline_function_is_over_60_lines() -> None:
    long = []
    for path in sorted((ROOT / "fp4prep" / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}: {node.name} is {lines} lines")
    assert long == []


def heavy_imports(module: str) -> set[str]:
    """The heavy libraries ``module`` imports, itself or through this project's modules, at the
    top level of a module (imports inside functions run only when those functions do)."""
    known = modules()
    found: set[str] = set()
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = known[name]
        is_package = path.name == "__init__.py"
        for node in ast.parse(path.read_text()).body:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                if target.split(".")[0] in HEAVY:
                    found.add(target.split(".")[0])
                elif target in known:
                    # A package's __init__ runs before any of its modules.
                    parts = target.split(".")
                    todo += [p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in known]
    return found


@pytest.mark.parametrize(
    "module",
    [
        "fp4prep.pipeline.inputs.adapter_files",
        "fp4prep.pipeline.inputs.conversations",
        "fp4prep.pipeline.inputs.corpus",
        "fp4prep.pipeline.inputs.general_text",
        "fp4prep.pipeline.formats",
        "fp4prep.pipeline.recipes",
        "fp4prep.pipeline.validation.report",
    ],
)
def test_what_the_web_process_reads_of_the_pipeline_imports_no_heavy_library(module: str) -> None:
    assert heavy_imports(module) == set()


def test_the_heavy_import_check_finds_a_heavy_import() -> None:
    assert "torch" in heavy_imports("fp4prep.pipeline.stages")
