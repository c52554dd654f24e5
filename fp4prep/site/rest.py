"""What every API endpoint shares: the error envelope, pagination and upload size limits."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.files.uploadhandler import FileUploadHandler, StopUpload, TemporaryFileUploadHandler
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, pagination
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from fp4prep.text import format_bytes

from .errors import ServiceError, TooLarge

DRF_CODES = {
    400: "invalid_request",
    401: "authentication_failed",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "throttled",
}


def error_response(status: int, code: str, message: str) -> Response:
    return Response({"error": {"code": code, "message": message}}, status=status)


def _flatten(detail: Any, prefix: str = "") -> list[str]:
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            out += _flatten(value, f"{prefix}{name}." if name else prefix)
        return out
    if isinstance(detail, list):
        return [m for item in detail for m in _flatten(item, prefix)]
    where = prefix.rstrip(".")
    return [f"{where}: {detail}" if where else str(detail)]


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Every error as ``{"error": {"code", "message"}}``."""
    if isinstance(exc, ServiceError):
        return error_response(exc.status, exc.code, exc.message)
    if isinstance(exc, Http404):
        return error_response(404, "not_found", "Not found")
    response = drf_exception_handler(exc, context)
    if response is None or not isinstance(exc, exceptions.APIException):
        return response
    if isinstance(exc, exceptions.ValidationError):
        message = "; ".join(_flatten(exc.detail))
    else:
        message = str(exc.detail)
    body = error_response(response.status_code, DRF_CODES.get(response.status_code, "error"), message)
    for header in ("WWW-Authenticate", "Allow", "Retry-After"):
        if header in response:
            body[header] = response[header]
    return body


class Pagination(pagination.PageNumberPagination):
    """``{"data": [...], "total", "page", "page_size", "next", "previous"}``, newest first."""

    page_size_query_param = "page_size"
    max_page_size = 100

    def get_paginated_response(self, data: Any) -> Response:
        assert self.page is not None
        return Response(
            {
                "data": data,
                "total": self.page.paginator.count,
                "page": self.page.number,
                "page_size": self.get_page_size(self.request) or self.page_size,
                "next": self.get_next_link(),
                "previous": self.get_previous_link(),
            }
        )

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["data", "total", "page", "page_size", "next", "previous"],
            "properties": {
                "data": schema,
                "total": {"type": "integer"},
                "page": {"type": "integer"},
                "page_size": {"type": "integer"},
                "next": {"type": "string", "nullable": True, "format": "uri"},
                "previous": {"type": "string", "nullable": True, "format": "uri"},
            },
        }


class SizeLimitHandler(FileUploadHandler):
    """Stops reading an uploaded file once it passes ``limit`` bytes: nothing past it is stored.

    The rest of the body is drained (not kept) so the client still reads the 413 response.
    """

    def __init__(self, request: Any, limit: int) -> None:
        super().__init__(request)
        self.limit = limit
        self.exceeded = False

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        if start + len(raw_data) > self.limit:
            self.exceeded = True
            raise StopUpload(connection_reset=False)
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None


# Multipart framing around one file and a few fields; a body over limit + this can't fit the limit.
MULTIPART_OVERHEAD = 64 * 1024


def limit_uploads(django_request: Any, limit: int) -> SizeLimitHandler:
    """Read uploads in this request through a size limit; call before anything reads the body."""
    limiter = SizeLimitHandler(django_request, limit)
    django_request.upload_handlers = [limiter, TemporaryFileUploadHandler(django_request)]
    return limiter


def uploaded_file(request: Any, field: str, limit: int, what: str, limiter: SizeLimitHandler | None = None) -> Any:
    """The uploaded file in ``field``, read through a size limit; 413 past it, 400 when missing.

    Pass ``limiter`` when the handlers were installed earlier (a page view checks CSRF, which reads
    the body, so its handlers go in first).
    """
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit + MULTIPART_OVERHEAD:
        raise TooLarge(f"{what} is larger than the limit of {format_bytes(limit)} (request body of {declared:,} bytes)")
    if limiter is None:
        limiter = limit_uploads(getattr(request, "_request", request), limit)  # a DRF request wraps Django's
    upload = request.FILES.get(field)  # parses the body through the handlers
    if limiter.exceeded:
        raise TooLarge(f"{what} is larger than the limit of {format_bytes(limit)}; nothing was stored")
    if upload is None:
        raise ServiceError(f"{field}: a file is required (multipart/form-data field '{field}')")
    return upload


# --- errors Django raises itself (before or around DRF's views) ---------------------------------------
# Under /v1/ they answer in the envelope too; elsewhere Django's own pages (templates/404.html, 500.html).


def envelope(request: HttpRequest, status: int, code: str, message: str) -> HttpResponse | None:
    """The API's error envelope for a request under ``/v1/``; None elsewhere."""
    if request.path.startswith("/v1/"):
        return JsonResponse({"error": {"code": code, "message": message}}, status=status)
    return None


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if isinstance(exception, RequestDataTooBig):
        found = envelope(request, 413, "payload_too_large", "Request body is larger than this endpoint accepts")
    elif isinstance(exception, (TooManyFieldsSent, TooManyFilesSent)):
        found = envelope(request, 400, "invalid_request", "Request has more form fields or files than any endpoint takes")
    else:
        found = envelope(request, 400, "invalid_request", "Bad request")
    return found or defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return envelope(request, 403, "permission_denied", "Permission denied") or defaults.permission_denied(request, exception)


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    found = envelope(request, 404, "not_found", "No API endpoint at this path; the endpoints are listed at /v1/docs")
    return found or defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    found = envelope(request, 500, "internal_error", "Internal error; it is logged for support. Try again in a moment")
    return found or defaults.server_error(request)
