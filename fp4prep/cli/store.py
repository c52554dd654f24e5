"""``fp4prep files …``, ``models …`` and ``whoami``: calibration files, the model registry and the
key's project on a server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fp4prep.client import Client

from . import exits
from . import output as out
from .connection import Refused, check_size, more, print_report


def cmd_files_upload(client: Client, args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_file():
        raise Refused(f"{path}: no such file")
    check_size(client, path)
    uploaded = client.files.upload(path, purpose=args.purpose)
    if args.json:
        out.dump(uploaded.raw)
    elif uploaded.status == "processed":
        print(f"Uploaded {uploaded.filename} as {uploaded.id}: processed, {uploaded.report.conversations} conversations.")
    else:
        print_report(uploaded.filename, uploaded.report)
        print(f"Kept as {uploaded.id} with its report; no job accepts it.", file=sys.stderr)
    return 0 if uploaded.status == "processed" else exits.INPUT


def cmd_files_list(client: Client, args: argparse.Namespace) -> int:
    page = client.files.list(page=args.page)
    if args.json:
        out.dump(page.raw)
        return 0
    if not page.data:
        print("No files yet. Upload one with: fp4prep files upload FILE.jsonl")
        return 0
    rows = [[f.id, f.filename, f.status, f.report.conversations, f.report.error_count, out.size(f.size_bytes), out.when(f.created_at)] for f in page.data]
    print(out.table(["ID", "FILENAME", "STATUS", "CONVERSATIONS", "ERRORS", "SIZE", "UPLOADED"], rows))
    more(page)
    return 0


def cmd_files_get(client: Client, args: argparse.Namespace) -> int:
    f = client.files.retrieve(args.file_id)
    if args.json:
        out.dump(f.raw)
        return 0
    print(out.facts([("File", f.id), ("Filename", f.filename), ("Status", f.status), ("Conversations", f.report.conversations),
                     ("Size", out.size(f.size_bytes)), ("SHA-256", f.sha256), ("Uploaded", out.when(f.created_at))]))
    if f.status != "processed":
        print_report(f.filename, f.report)
    return 0


def cmd_models_list(client: Client, args: argparse.Namespace) -> int:
    page = client.models.list(kind=args.kind, page=args.page)
    if args.json:
        out.dump(page.raw)
        return 0
    rows = [[m.id, m.kind, m.name, m.base_model, m.latest_revision.id if m.latest_revision else ""] for m in page.data]
    print(out.table(["ID", "KIND", "NAME", "BASE", "LATEST REVISION"], rows))
    more(page)
    return 0


def cmd_models_get(client: Client, args: argparse.Namespace) -> int:
    model = client.models.retrieve(args.model_id)
    if args.json:
        out.dump(model.raw)
        return 0
    rows: list[tuple[str, Any]] = [("Model", model.id), ("Kind", model.kind), ("Name", model.name), ("Base", model.base_model)]
    if model.source_adapter_id:
        rows.append(("From adapter", model.source_adapter_id))
    print(out.facts(rows))
    revisions = client.models.revisions(model.id)
    print()
    print(out.table(["REVISION", "#", "SIZE", "FILES", "CREATED"],
                    [[r.id, r.number, out.size(r.size_bytes), len(r.files), out.when(r.created_at)] for r in revisions.data]))
    return 0


def cmd_models_configs(client: Client, args: argparse.Namespace) -> int:
    profiles = client.models.configs(args.model_id)
    if args.json:
        out.dump({"data": [p.raw for p in profiles]})
        return 0
    if not profiles:
        print(f"No deployment profiles for {args.model_id}.")
        return 0
    print(out.table(["CONFIG", "NAME", "HARDWARE", "GPUS", "QUANTIZATION"],
                    [[p.id, p.name, p.hardware, p.gpu_count, p.quantization] for p in profiles]))
    return 0


def cmd_models_download(client: Client, args: argparse.Namespace) -> int:
    revision_id = args.revision
    if not revision_id:
        latest = client.models.retrieve(args.model_id).latest_revision
        if latest is None:
            raise Refused(f"model {args.model_id} has no revisions to download")
        revision_id = latest.id
    target = Path(args.output or f"{args.model_id}-{revision_id}")
    if target.exists() and any(target.iterdir()):
        raise Refused(f"{target} exists and is not empty; pass --output with a new directory")
    bar: Any = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, file=sys.stderr, desc="download")

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total or None
            bar.update(done - bar.n)

    try:
        client.models.download(args.model_id, revision_id, target, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    files = sorted(p for p in target.rglob("*") if p.is_file())
    print(f"Downloaded {args.model_id} revision {revision_id} to {target}/ ({len(files)} files, {out.size(sum(p.stat().st_size for p in files))}).")
    return 0


def cmd_keys_create(client: Client, args: argparse.Namespace) -> int:
    key = client.keys.create(args.name, args.scope)
    if args.json:
        out.dump(key.raw)
        return 0
    print(key.key)
    print(f"Created {key.prefix}… ({key.name or 'unnamed'}, scope {key.scope}). It is shown only this once: keep it now.",
          file=sys.stderr)
    return 0


def cmd_keys_list(client: Client, args: argparse.Namespace) -> int:
    page = client.keys.list(page=args.page)
    if args.json:
        out.dump(page.raw)
        return 0
    rows = [[f"{k.prefix}…", k.name or "-", k.scope, out.when(k.created_at), out.when(k.last_used_at) if k.last_used_at else "never",
             "revoked" if k.revoked_at else "active"] for k in page.data]
    print(out.table(["KEY", "NAME", "SCOPE", "CREATED", "LAST USED", "STATE"], rows))
    more(page)
    return 0


def cmd_whoami(client: Client, args: argparse.Namespace) -> int:
    project = client.whoami()
    if args.json:
        out.dump(project.raw)
        return 0
    print(out.facts([("Project", project.id), ("Name", project.name), ("Key scope", project.key_scope),
                     ("Blocked", "yes" if project.blocked else "no"),
                     ("Balance", out.usd(project.balance_usd)), ("Held", out.usd(project.held_usd)),
                     ("Available", out.usd(project.available_usd)), ("Server", client.base_url)]))
    return 0
