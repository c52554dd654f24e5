"""The pipeline's exceptions: what the user must fix, what went wrong on our side, and a stop."""

from __future__ import annotations


class PipelineError(Exception):
    """Something failed on our side; retrying may help. The message is safe to show a user."""


class InternalError(PipelineError):
    """An unexpected failure inside a stage. Its message carries the exception's own text: right
    for the local command's user and a worker's log, not for a hosted job's customer."""


class UserError(PipelineError):
    """The input is at fault (adapter, base, calibration file); the message says how to fix it."""


class Cancelled(Exception):  # noqa: N818 - reads as a state, like KeyboardInterrupt
    """The run stopped because its cancellation check said so."""
