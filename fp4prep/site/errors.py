"""Errors the service shows its users. Every way in (API, pages, admin, CLI) shows the same message.

The REST API renders them as ``{"error": {"code": ..., "message": ...}}`` with ``status``.
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class InvalidInput(ServiceError):
    status = 400
    code = "invalid_request"


class PaymentRequired(ServiceError):
    status = 402
    code = "insufficient_credit"


class Forbidden(ServiceError):
    status = 403
    code = "project_blocked"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


class TooLarge(ServiceError):
    status = 413
    code = "payload_too_large"


def check_length(field: str, value: str, limit: int) -> str:
    """``value`` if it fits its column's ``limit`` characters; otherwise a 400 naming ``field``."""
    if len(value) > limit:
        raise InvalidInput(f"{field}: at most {limit:,} characters, not {len(value):,}")
    return value
