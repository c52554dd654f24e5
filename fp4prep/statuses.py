"""A job's statuses, as the API names them, and which of them are final. Imports nothing: the
light client, the CLI and the service all read them from here."""

from __future__ import annotations

STATUSES = ("pending", "queued", "running", "cancel_requested", "cancelled", "completed", "error", "user_error")
# A job in one of these has ended and never changes again.
TERMINAL = frozenset({"completed", "cancelled", "error", "user_error"})
CANCELLABLE = frozenset({"pending", "queued", "running"})
