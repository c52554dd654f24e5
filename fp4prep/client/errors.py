"""Exceptions of the Python client: each API error carries the HTTP status, the server's error code
and its message (the same message the dashboard and the CLI show)."""

from __future__ import annotations


class Fp4prepError(Exception):
    """Anything the client raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigurationError(Fp4prepError):
    """No API key, or a base URL that can't be used."""


class APIConnectionError(Fp4prepError):
    """The server could not be reached (after retries, for calls that are safe to repeat)."""


class APIError(Fp4prepError):
    status: int = 0

    def __init__(self, message: str, *, status: int, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def __str__(self) -> str:
        return self.message


class BadRequestError(APIError):  # 400
    pass


class AuthenticationError(APIError):  # 401
    pass


class PaymentRequiredError(APIError):  # 402: the project's credit can't cover the price
    pass


class PermissionDeniedError(APIError):  # 403: e.g. the project is blocked
    pass


class NotFoundError(APIError):  # 404, also for objects of another project
    pass


class ConflictError(APIError):  # 409: e.g. a job that isn't cancellable
    pass


class PayloadTooLargeError(APIError):  # 413
    pass


class InternalServerError(APIError):  # 5xx
    pass


BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: PaymentRequiredError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
}


def error_for(status: int, code: str, message: str) -> APIError:
    cls = BY_STATUS.get(status) or (InternalServerError if status >= 500 else APIError)
    return cls(message, status=status, code=code)
