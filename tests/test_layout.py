"""The code's shape, checked: the product (``fp4prep`` outside ``fp4prep.site``) imports neither
Django nor the apps, no import cycles, the registry stands below jobs and the demo, and no module
grows past 400 lines without saying why at its top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .imports import ROOT, cycles, import_graph, imports_of, mermaid, modules, package_graph, reachable

MAX_LINES = 400

# The web framework and the apps: what the product must not import. ``pip install fp4prep`` brings a
# script the product alone; the service installs Django beside it.
SERVICE_ONLY = ("django", "rest_framework", "drf_spectacular", "django_q", "django_htmx", "template_partials",
                "axes", "whitenoise", "registry", "jobs", "fp4prep.site")
# Product modules allowed to import from SERVICE_ONLY, each with its reason. None today.
PRODUCT_EXCEPTIONS: dict[str, str] = {}


def service_imports(name: str, path: Path) -> set[str]:
    return {t for t in imports_of(name, path) if t.split(".")[0] in SERVICE_ONLY or t.startswith("fp4prep.site")}


def test_the_product_imports_neither_django_nor_the_apps() -> None:
    product = {n: p for n, p in modules().items() if n.startswith("fp4prep") and not n.startswith("fp4prep.site")}
    assert len(product) > 50 and "fp4prep.pipeline.stages" in product and "fp4prep.cli" in product
    found = {n: sorted(service_imports(n, p)) for n, p in product.items() if n not in PRODUCT_EXCEPTIONS}
    assert {n: t for n, t in found.items() if t} == {}


def test_the_product_check_finds_an_import_of_django_or_an_app(tmp_path: Path) -> None:
    module = tmp_path / "report.py"
    module.write_text("import os\n\ndef f():\n    from django.conf import settings\n    from ..site import pages\n    import jobs.models\n")
    assert service_imports("fp4prep.pipeline.report", module) == {
        "django.conf", "django.conf.settings", "fp4prep.site", "fp4prep.site.pages", "jobs.models",
    }


def test_the_drawing_of_the_packages_has_no_arrow_from_the_product_to_the_site() -> None:
    graph = package_graph()
    site = {"fp4prep.site", "registry", "jobs"}
    assert site < set(graph) and {"fp4prep.pipeline.model", "fp4prep.cli", "fp4prep.demo"} < set(graph)
    assert {(a, b) for a in set(graph) - site for b in graph[a] & site} == set()
    assert "jobs --> fp4prep_pipeline" in mermaid()  # the site uses the product


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


def test_the_docs_name_every_package_and_every_module_says_what_it_is() -> None:
    """The layout page names packages; each module says what it is in its own docstring (a new
    module needs no edit elsewhere)."""
    layout = (ROOT / "docs" / "development.md").read_text()
    packages = sorted(name for name, path in modules().items() if path.name == "__init__.py")
    assert len(packages) > 15 and "fp4prep.site" in packages and "fp4prep.pipeline.model" in packages
    assert [p for p in packages if f"`{p}`" not in layout] == []
    silent = [str(path.relative_to(ROOT)) for path in modules().values() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert silent == []


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
        "fp4prep.pipeline.config",
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
