"""Plain helpers for the service tests: waiting for a state, and reading a job's ledger."""

from __future__ import annotations

import time
from typing import Any


def wait_for(predicate: Any, timeout: float = 120, what: str = "condition", interval: float = 0.1) -> Any:
    """``predicate()``'s first true value, polled until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def ledger_of(job_id: str) -> list[str]:
    """The kinds of the credit transactions a job made, oldest first (``["hold", "charge"]``)."""
    from registry.models import CreditTransaction

    return list(CreditTransaction.objects.filter(job_id=job_id).order_by("created_at", "id").values_list("kind", flat=True))
