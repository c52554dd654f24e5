"""The client's address, as every limit keyed on an address sees it (the API's rate for requests
without a valid key, sign-in lockouts): the socket's peer, or with ``FP4PREP_TRUSTED_PROXIES`` N, the
address the Nth proxy from the end of ``X-Forwarded-For`` saw. Entries before it were written by
the client and are never believed."""

from __future__ import annotations

from typing import Any

from django.conf import settings


def client_address(request: Any) -> str:
    meta = request.META
    peer = str(meta.get("REMOTE_ADDR") or "")
    proxies = int(getattr(settings, "TRUSTED_PROXIES", 0))
    forwarded = meta.get("HTTP_X_FORWARDED_FOR")
    if not proxies or not forwarded:
        return peer
    hops = [h.strip() for h in str(forwarded).split(",")]
    return hops[-min(proxies, len(hops))] or peer
