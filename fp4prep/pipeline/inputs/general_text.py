"""The general-text half of the calibration corpus.

The embedded default needs no network and no data files: it is the English documentation that
ships inside the Python standard library (module, class and function docstrings of a fixed list
of modules, in a fixed order), under the PSF license. It is deterministic for a given Python
version. A configured source replaces it: a ``.txt`` file of blank-line separated documents or a
``.jsonl`` file of ``{"text": ...}`` rows.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError

DEFAULT_MODULES = (
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gzip",
    "hashlib",
    "heapq",
    "html.parser",
    "http.client",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "multiprocessing.pool",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
)
MIN_DOCUMENT_CHARS = 200


def _docstrings(module_name: str) -> Iterator[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    doc = inspect.getdoc(module)
    if doc:
        yield doc
    for name in sorted(getattr(module, "__all__", None) or dir(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc:
                yield doc
            if inspect.isclass(obj):
                for attr in sorted(vars(obj)):
                    member = vars(obj)[attr]
                    if not attr.startswith("_") and inspect.isfunction(member):
                        doc = inspect.getdoc(member)
                        if doc:
                            yield doc


def default_documents() -> Iterator[str]:
    seen: set[str] = set()
    for module_name in DEFAULT_MODULES:
        for doc in _docstrings(module_name):
            if len(doc) >= MIN_DOCUMENT_CHARS and doc not in seen:
                seen.add(doc)
                yield doc


def file_documents(path: Path) -> Iterator[str]:
    if not path.is_file():
        raise UserError(f"general text source {path} does not exist")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(f'{path.name} line {number}: expected {{"text": ...}}') from None
                if isinstance(text, str) and text.strip():
                    yield text
    else:
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            if block.strip():
                yield block.strip()


def documents(path: Path | None = None) -> Iterator[str]:
    return file_documents(path) if path is not None else default_documents()
