"""The commands that talk to an fp4prep server through the Python client (``fp4prep.client``):
``training fp4 …`` (``training``), ``files``, ``models`` and ``whoami`` (``store``). Exit statuses
are the table in ``fp4prep.cli.exits``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .connection import run
from .store import (
    cmd_files_get,
    cmd_files_list,
    cmd_files_upload,
    cmd_keys_create,
    cmd_keys_list,
    cmd_models_configs,
    cmd_models_download,
    cmd_models_get,
    cmd_models_list,
    cmd_whoami,
)
from .training import cmd_cancel, cmd_create, cmd_estimate, cmd_get, cmd_list, cmd_list_events


def add_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-key", default=None, help="default: $FP4PREP_API_KEY")
    common.add_argument("--base-url", default=None, help="default: $FP4PREP_BASE_URL, else http://127.0.0.1:8000")
    reads = argparse.ArgumentParser(add_help=False, parents=[common])
    reads.add_argument("--json", action="store_true", help="print the API's JSON")

    def command(group: Any, name: str, handler: Any, help: str, read: bool = True) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = group.add_parser(name, help=help, parents=[reads if read else common])
        parser.set_defaults(func=lambda args: run(handler, args))
        return parser

    training = sub.add_parser("training", help="jobs on the server").add_subparsers(dest="group", required=True)
    fp4 = training.add_parser("fp4", help="prepare adapters for FP4 inference").add_subparsers(dest="verb", required=True)
    for name, handler, help in (
        ("estimate", cmd_estimate, "price and running time of a job; creates nothing"),
        ("create", cmd_create, "start a job (asks to confirm in a terminal)"),
    ):
        p = command(fp4, name, handler, help)
        p.add_argument("model_id", metavar="ML", help="the adapter's model ID (ml_...)")
        p.add_argument("--adapter-revision-id", metavar="RV", help="default: the adapter's latest revision")
        p.add_argument("--calibration-file", "-c", metavar="FILE_OR_ID", help="a local JSONL file (uploaded) or a file ID")
        if name == "create":
            p.add_argument("--confirm", "-y", action="store_true", help="don't ask")
            p.add_argument("--watch", action="store_true", help="then watch the job until it ends")
            p.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default 5)")
    p = command(fp4, "get", cmd_get, "a job; --watch follows it until it ends")
    p.add_argument("job_id", metavar="JOB")
    p.add_argument("--watch", action="store_true", help="print each status change and new event until the job ends")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default 5)")
    p = command(fp4, "list", cmd_list, "the project's jobs, newest first")
    p.add_argument("--status", help="only these statuses (comma-separated)")
    p.add_argument("--page", type=int)
    p = command(fp4, "list-events", cmd_list_events, "a job's events, oldest first")
    p.add_argument("job_id", metavar="JOB")
    p = command(fp4, "cancel", cmd_cancel, "request cancellation (asks to confirm in a terminal)")
    p.add_argument("job_id", metavar="JOB")
    p.add_argument("--force", "-y", action="store_true", help="don't ask")

    files = sub.add_parser("files", help="calibration files").add_subparsers(dest="verb", required=True)
    p = command(files, "upload", cmd_files_upload, "upload and validate a JSONL file")
    p.add_argument("path", type=Path)
    p.add_argument("--purpose", default="calibration")
    p = command(files, "list", cmd_files_list, "the project's files")
    p.add_argument("--page", type=int)
    p = command(files, "get", cmd_files_get, "a file and its validation report")
    p.add_argument("file_id", metavar="FILE")

    models = sub.add_parser("models", help="the model registry").add_subparsers(dest="verb", required=True)
    p = command(models, "list", cmd_models_list, "the project's models and the public bases")
    p.add_argument("--kind", choices=["base", "adapter", "merged", "full", "prepared"])
    p.add_argument("--page", type=int)
    p = command(models, "get", cmd_models_get, "a model and its revisions")
    p.add_argument("model_id", metavar="ML")
    p = command(models, "configs", cmd_models_configs, "deployment profiles of a model")
    p.add_argument("model_id", metavar="ML")
    p = command(models, "download", cmd_models_download, "download and unpack a revision", read=False)
    p.add_argument("model_id", metavar="ML")
    p.add_argument("--revision", metavar="RV", help="default: the latest")
    p.add_argument("--output", "-o", metavar="DIR", help="default: ./ML-RV")

    keys = sub.add_parser("keys", help="the project's API keys").add_subparsers(dest="verb", required=True)
    p = command(keys, "create", cmd_keys_create, "make a key (shown once); needs a key of the full scope")
    p.add_argument("--name", default="", help="what it is for, e.g. 'CI pipeline'")
    p.add_argument("--scope", choices=["full", "read"], default="full",
                   help="full: everything the project may do; read: list and fetch only (default full)")
    p = command(keys, "list", cmd_keys_list, "the project's keys (never the keys themselves)")
    p.add_argument("--page", type=int)

    command(sub, "whoami", cmd_whoami, "the API key's project and its credit")
