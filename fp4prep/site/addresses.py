"""The client's address, as every limit keyed on an address sees it (the API's rate for requests
without a valid key, sign-in lockouts): the socket's peer, or with ``FP4PREP_TRUSTED_PROXIES`` N, the
address the Nth proxy from the end of ``X-Forwarded-For`` saw. Entries before it were written by
the client and are never believed."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings

logger = logging.getLogger(__name__)


def client_address(request: Any) -> str:
    meta = request.META
    peer = str(meta.get("REMOTE_ADDR") or "")
    proxies = int(getattr(settings, "TRUSTED_PROXIES", 0))
    forwarded = meta.get("HTTP_X_FORWARDED_FOR")
    if not proxies or not forwarded:
        return peer
    hops = [h.strip() for h in str(forwarded).split(",")]
    return hops[-min(proxies, len(hops))] or peer


class DirectClients:
    """With trusted proxies set, a request that carries no X-Forwarded-For reached the web port
    without passing a proxy: so can a client that writes its own header and chooses its address.
    Logged once per process, as a warning to bind the web processes where only the proxy reaches."""

    warned = False

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        if not DirectClients.warned and int(getattr(settings, "TRUSTED_PROXIES", 0)) and "HTTP_X_FORWARDED_FOR" not in request.META:
            DirectClients.warned = True
            logger.warning(
                "FP4PREP_TRUSTED_PROXIES is %s, but a request from %s reached the web port with no X-Forwarded-For: "
                "clients that reach it directly choose their own address (rates, sign-in lockouts). "
                "Bind the web processes where only the proxy reaches them.",
                settings.TRUSTED_PROXIES, request.META.get("REMOTE_ADDR", "?"),
            )
        return self.get_response(request)
