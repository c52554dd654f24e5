"""The ``fp4prep`` command.

Local (no server): ``quantize`` runs the pipeline on a checkpoint directory, ``demo`` on the
embedded demo. Against a server: ``training fp4 ...``, ``files ...``, ``models ...``, ``whoami``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import local, remote


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4prep", description="Prepare LoRA adapters for FP4 inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    local.add_commands(sub)
    remote.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command in ("quantize", "demo"):
        local.quiet_libraries()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
