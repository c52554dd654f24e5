"""MkDocs hooks: the pages built from the code at build time.

- ``api.md``: the REST API reference, rendered from the OpenAPI schema drf-spectacular generates
  from the live views and serializers, with the raw schema beside it as ``openapi.json``.
- The import drawing in ``development.md``: ``tests.imports.mermaid()``, the package-level import
  graph, put where the page has the line ``<!-- import-drawing -->``.

Nothing here is a copy of the code's answers: rebuild the docs and both follow the code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

DRAWING_PLACEHOLDER = "<!-- import-drawing -->"
METHODS = ("get", "post", "put", "patch", "delete")


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _on_path(config: MkDocsConfig) -> None:
    root = str(_root(config))
    if root not in sys.path:
        sys.path.insert(0, root)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    schema = openapi_schema(config)
    files.append(File.generated(config, "openapi.json", content=json.dumps(schema, indent=2, default=str) + "\n"))
    files.append(File.generated(config, "api.md", content=api_markdown(schema)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if DRAWING_PLACEHOLDER not in markdown:
        return markdown
    _on_path(config)
    from tests.imports import mermaid

    return markdown.replace(DRAWING_PLACEHOLDER, "```mermaid\n" + mermaid().rstrip("\n") + "\n```")


# --- The API reference --------------------------------------------------------------------------


def openapi_schema(config: MkDocsConfig) -> dict[str, Any]:
    """The schema ``GET /v1/schema`` serves, generated from the code."""
    _on_path(config)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fp4prep.site.settings")
    import django

    django.setup()
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    # Round-trip through JSON: what the page shows is what openapi.json holds (lazy strings resolved).
    return json.loads(json.dumps(schema, default=str))


def api_markdown(schema: dict[str, Any]) -> str:
    info = schema.get("info", {})
    components = schema.get("components", {})
    lines = [
        "# REST API reference",
        "",
        "<!-- Generated at build time from the OpenAPI schema of the code (docs/hooks/generated.py). -->",
        "",
        f"{info.get('title', 'API')}, version {info.get('version', '?')} (OpenAPI {schema.get('openapi', '?')}). "
        + _text(info.get("description", "")),
        "",
        "This page is generated when the documentation is built, from the schema drf-spectacular makes of "
        "the live views and serializers: the same schema a running server serves at `GET /v1/schema` "
        "and shows at `/v1/docs`. The raw schema: [openapi.json](openapi.json). What the endpoints are "
        "for, with examples, is in [The service](service.md); errors and limits in "
        "[Limits, hostile input and faults](limits.md).",
        "",
    ]
    lines += _security(schema, components.get("securitySchemes", {}))
    lines += ["## Endpoints", "", "| method | path | summary |", "|---|---|---|"]
    operations = list(_operations(schema))
    for method, path, operation in operations:
        anchor = _operation_anchor(method, path)
        summary = operation.get("summary") or operation.get("description", "").split("\n")[0]
        lines.append(f"| [{method.upper()}](#{anchor}) | `{path}` | {_cell(summary)} |")
    lines.append("")
    for method, path, operation in operations:
        lines += _operation(method, path, operation)
    lines += _schemas(components.get("schemas", {}))
    return "\n".join(lines) + "\n"


def _operations(schema: dict[str, Any]) -> Any:
    for path, item in schema.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                yield method, path, item[method]


def _operation_anchor(method: str, path: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in path.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"{method}-{slug}"


def _security(schema: dict[str, Any], schemes: dict[str, Any]) -> list[str]:
    if not schemes:
        return []
    lines = ["## Authentication", ""]
    for name, scheme in schemes.items():
        if scheme.get("type") == "http":
            how = f"HTTP `{scheme.get('scheme', '')}` authentication"
        elif scheme.get("type") == "apiKey":
            how = f"an API key in the {scheme.get('in', '')} `{scheme.get('name', '')}`"
        else:
            how = str(scheme.get("type", ""))
        description = _text(scheme.get("description", ""))
        lines.append(f"- `{name}`: {how}." + (f" {description}" if description else ""))
    lines += ["", "Each endpoint below names the schemes it takes (security).", ""]
    return lines


def _operation(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    lines = [f"## {method.upper()} `{path}` {{#{_operation_anchor(method, path)}}}", ""]
    if operation.get("summary"):
        lines += [f"**{_text(operation['summary'])}**", ""]
    if operation.get("description"):
        lines += [_text(line) for line in operation["description"].strip().split("\n")] + [""]
    facts = [f"operation `{operation['operationId']}`"] if operation.get("operationId") else []
    if operation.get("tags"):
        facts.append("tags: " + ", ".join(f"`{t}`" for t in operation["tags"]))
    security = [name for entry in operation.get("security", []) for name in entry] or ["none"]
    facts.append("security: " + ", ".join(f"`{s}`" for s in security))
    lines += ["; ".join(facts) + ".", ""]
    parameters = operation.get("parameters", [])
    if parameters:
        lines += ["**Parameters**", "", "| name | in | required | type | description |", "|---|---|---|---|---|"]
        for p in parameters:
            lines.append(
                f"| `{p.get('name')}` | {p.get('in', '')} | {'yes' if p.get('required') else 'no'} "
                f"| {_type(p.get('schema', {}))} | {_cell(p.get('description', ''))} |"
            )
        lines.append("")
    body = operation.get("requestBody")
    if body:
        required = "required" if body.get("required") else "optional"
        lines += [f"**Request body** ({required})", ""]
        for media, content in body.get("content", {}).items():
            lines.append(f"- `{media}`: {_type(content.get('schema', {}))}")
        lines.append("")
    responses = operation.get("responses", {})
    if responses:
        lines += ["**Responses**", "", "| status | description | content |", "|---|---|---|"]
        for status, response in responses.items():
            content = response.get("content", {})
            body_types = "; ".join(f"`{m}`: {_type(c.get('schema', {}))}" for m, c in content.items()) or "none"
            lines.append(f"| {status} | {_cell(response.get('description', ''))} | {body_types} |")
        lines.append("")
    return lines


def _schemas(schemas: dict[str, Any]) -> list[str]:
    if not schemas:
        return []
    lines = [
        "## Schemas",
        "",
        "The bodies the endpoints above take and answer, by the names the schema gives them. "
        "Read-only fields are set by the server; a request's schema leaves them out.",
        "",
    ]
    for name, schema in schemas.items():
        lines += [f"### {name} {{#{_schema_anchor(name)}}}", ""]
        if schema.get("enum"):
            lines += ["One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".", ""]
            continue
        if schema.get("description"):
            lines += [_text(schema["description"]), ""]
        properties = schema.get("properties", {})
        if not properties:
            lines += [f"Type: {_type(schema)}.", ""]
            continue
        required = set(schema.get("required", []))
        lines += ["| field | type | required | description |", "|---|---|---|---|"]
        for field, prop in properties.items():
            lines.append(
                f"| `{field}` | {_type(prop)} | {'yes' if field in required else 'no'} "
                f"| {_cell(_property_notes(prop))} |"
            )
        lines.append("")
    return lines


def _schema_anchor(name: str) -> str:
    return "schema-" + name.lower()


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(schema: dict[str, Any]) -> str:
    """A schema as words: component names link to their section below."""
    if not schema:
        return "any"
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{_schema_anchor(name)})"
    for combiner, word in (("allOf", " and "), ("oneOf", " or "), ("anyOf", " or ")):
        if combiner in schema:
            inner = word.join(_type(s) for s in schema[combiner])
            return inner + (", nullable" if schema.get("nullable") else "")
    kind = schema.get("type")
    if kind == "array":
        text = "array of " + _type(schema.get("items", {}))
    elif kind == "object" and schema.get("properties"):
        fields = ", ".join(f"`{k}`: {_type(v)}" for k, v in schema["properties"].items())
        text = "object {" + fields + "}"
    elif kind:
        text = f"{kind}" + (f" ({schema['format']})" if schema.get("format") else "")
    else:
        text = "any"
    if schema.get("enum"):
        text += ", one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    if schema.get("nullable"):
        text += ", nullable"
    return text


def _property_notes(prop: dict[str, Any]) -> str:
    notes = []
    if prop.get("description") and not prop.get("enum"):
        notes.append(_text(prop["description"]))
    if prop.get("readOnly"):
        notes.append("read-only")
    if prop.get("writeOnly"):
        notes.append("write-only")
    if "maxLength" in prop:
        notes.append(f"at most {prop['maxLength']} characters")
    if "minLength" in prop and prop["minLength"] > 0:
        notes.append(f"at least {prop['minLength']} character{'s' if prop['minLength'] != 1 else ''}")
    return "; ".join(notes)


def _text(text: str) -> str:
    """One line of text, safe in Markdown: ``<event id>`` outside a code span is not an HTML tag."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|") or "—"
