"""What every response gets: bounded request bodies and a Content-Security-Policy.

Request bodies are bounded everywhere: only the upload views take more than a small form or JSON.
Django reads at most the declared Content-Length, so refusing a large declaration before any view
(or the CSRF check) reads the body means it is never read, spooled or parsed. The upload views set
their own, larger limits and enforce them while streaming.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

from fp4prep.text import format_bytes

from .rest import envelope


def takes_uploads(view: Any) -> Any:
    """Mark a view (function or API class) as one that takes file uploads with its own limit."""
    view.takes_uploads = True
    return view


def _takes_uploads(view_func: Any) -> bool:
    for candidate in (view_func, getattr(view_func, "cls", None), getattr(view_func, "view_class", None)):
        if getattr(candidate, "takes_uploads", False):
            return True
    return False


class BodyLimit:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func: Any, args: Any, kwargs: Any) -> HttpResponse | None:
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        limit = settings.REQUEST_MAX_BYTES
        if declared <= limit or _takes_uploads(view_func):
            return None
        message = f"Request body of {declared:,} bytes is over the limit of {format_bytes(limit)} for this endpoint"
        if request.path.startswith("/v1/"):
            return JsonResponse({"error": {"code": "payload_too_large", "message": message}}, status=413)
        return HttpResponse(message, status=413, content_type="text/plain")


# The app's own scripts (htmx, fp4prep.js) and stylesheet only: no inline script, handler or style,
# no other origin. Images: the app's and the favicon's data: URL.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "font-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])


class ContentSecurityPolicy:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        return response


class OutOfMemory:
    """A request whose handling ran out of memory answers 413 and stores nothing, never a 500: the
    upload code writes inside transactions and temporary files that an exception rolls back and
    removes, and this turns what is left, the MemoryError, into the answer (the API's envelope
    under ``/v1/``, a plain page elsewhere)."""

    MESSAGE = "The request needs more memory than the server gives one request; nothing was stored"

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, MemoryError):
            return None
        if transaction.get_connection().in_atomic_block:
            transaction.set_rollback(True)
        found = envelope(request, 413, "payload_too_large", self.MESSAGE)
        return found or HttpResponse(self.MESSAGE, status=413, content_type="text/plain; charset=utf-8")
