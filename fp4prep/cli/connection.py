"""What every command that talks to a server shares: the client from ``--api-key``/``--base-url``
(or FP4PREP_API_KEY/FP4PREP_BASE_URL), one line on stderr and an exit status for every failure
(``exits``), and the checks made before anything is sent."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fp4prep.client import Client
from fp4prep.client.errors import APIError, ConfigurationError, Fp4prepError

from . import exits
from . import output as out


class Refused(Exception):
    """A clear one-line reason the command stops, with its exit code."""

    def __init__(self, message: str, code: int = exits.INPUT) -> None:
        super().__init__(message)
        self.code = code


def client_of(args: argparse.Namespace) -> Client:
    if not (args.api_key or os.environ.get("FP4PREP_API_KEY")):
        raise Refused("no API key: pass --api-key or set FP4PREP_API_KEY (create one on the dashboard's API keys page)")
    return Client(api_key=args.api_key, base_url=args.base_url)


def run(handler: Any, args: argparse.Namespace) -> int:
    """Every API command goes through here: errors become one line on stderr and an exit code."""
    try:
        return int(handler(client_of(args), args) or 0)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except APIError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exits.INPUT if exc.status < 500 else exits.ERROR
    except ConfigurationError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exits.INPUT
    except Fp4prepError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exits.ERROR


def check_size(client: Client, path: Path) -> None:
    """Refuse a calibration file the server would refuse, before uploading (or estimating) it."""
    limit = client.whoami().limits.get("calibration_file_bytes")
    size = path.stat().st_size
    if limit and size > limit:
        raise Refused(
            f"--calibration-file {path}: {out.size(size)} is over the server's limit of {out.size(limit)} for a "
            "calibration file; use fewer conversations"
        )


def print_report(filename: str, report: Any) -> None:
    print(f"{filename} did not pass validation ({report.error_count} error{'s' if report.error_count != 1 else ''}):", file=sys.stderr)
    for error in report.errors:
        print(f"  line {error.line}: {error.message}", file=sys.stderr)
    if report.error_count > len(report.errors):
        print(f"  ... and {report.error_count - len(report.errors)} more", file=sys.stderr)


def more(page: Any) -> None:
    if page.next:
        print(f"(page {page.page} of {-(-page.total // page.page_size)}; --page {page.page + 1} for more)")
