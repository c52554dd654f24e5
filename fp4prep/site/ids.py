"""Opaque, prefixed, random IDs: nothing sequential leaks through an ID."""

from __future__ import annotations

import secrets
import string

ALPHABET = string.ascii_letters + string.digits


def _random(length: int) -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(length))


def project_id() -> str:
    return "proj_" + _random(20)


def model_id() -> str:
    return "ml_" + _random(20)


def revision_id() -> str:
    return "rv_" + _random(20)


def profile_id() -> str:
    return "cr_" + _random(21)


def file_id() -> str:
    return "file-" + secrets.token_hex(12)


def job_id() -> str:
    return f"shp-quant-{secrets.token_hex(4)}-{secrets.token_hex(2)}"


def api_key() -> str:
    return "fp4_" + secrets.token_urlsafe(32)
