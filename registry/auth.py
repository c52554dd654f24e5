"""API keys as bearer tokens: each request acts for the key's project and sees only that project."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from rest_framework import authentication, exceptions, permissions, throttling

from fp4prep.site.addresses import client_address

from .models import ApiKey, Project

logger = logging.getLogger(__name__)


class ProjectPrincipal:
    """``request.user`` for an API request: the project the key belongs to."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, project: Project) -> None:
        self.project = project

    def __str__(self) -> str:
        return self.project.id


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Any) -> tuple[ProjectPrincipal, ApiKey] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        keyword, _, raw = header.partition(" ")
        if keyword != self.keyword or not raw.strip():
            AddressThrottle.check(request)
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <api key>'")
        key = ApiKey.find(raw.strip())
        if key is None:
            AddressThrottle.check(request)  # guessing keys costs the address its unauthenticated rate
            raise exceptions.AuthenticationFailed("API key is not valid or was revoked")
        now = timezone.now()
        if key.last_used_at is None or now - key.last_used_at > timedelta(minutes=5):
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)  # coarse, so reads stay reads
        return ProjectPrincipal(key.project), key

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="fp4prep"'


class HasProject(permissions.BasePermission):
    """A valid key, and for anything but reading (GET, HEAD, OPTIONS) a key of the ``full`` scope."""

    def has_permission(self, request: Any, view: Any) -> bool:
        if not isinstance(request.user, ProjectPrincipal):
            AddressThrottle.check(request)
            raise exceptions.NotAuthenticated("Send your API key: 'Authorization: Bearer <api key>'")
        key = request.auth
        if isinstance(key, ApiKey) and key.scope != ApiKey.Scope.FULL and request.method not in permissions.SAFE_METHODS:
            raise exceptions.PermissionDenied(
                f"API key {key.prefix}… has the {key.scope} scope: it lists and fetches, and may not "
                f"{request.method} here; use a key of the full scope"
            )
        return True


def project_of(request: Any) -> Project:
    return request.user.project


class _CacheThrottle(throttling.SimpleRateThrottle):
    """A rate from settings, counted in the cache that every web process shares. If that cache
    can't be reached the request goes through: throttling protects the service, it must not take
    it down."""

    setting = ""

    def get_rate(self) -> str:
        return str(getattr(settings, self.setting))

    def allow_request(self, request: Any, view: Any) -> bool:
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        try:
            return super().allow_request(request, view)
        except exceptions.APIException:
            raise
        except Exception as exc:  # the cache is down: let the request through
            logger.warning("API throttle's cache is unreachable (%s); not throttling", exc)
            return True


class PerKeyThrottle(_CacheThrottle):
    """Each API key gets ``FP4PREP_API_RATE`` requests (e.g. ``1200/min``)."""

    scope = "api_key"
    setting = "API_RATE"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        key = getattr(request, "auth", None)
        if not isinstance(key, ApiKey):
            return None  # unauthenticated requests count against their address
        return f"throttle_{self.scope}_{key.hashed[:24]}"


class PerProjectThrottle(_CacheThrottle):
    """All of a project's keys together get ``FP4PREP_API_PROJECT_RATE``: keys are free to mint,
    so the per-key rate alone would not bound a project."""

    scope = "api_project"
    setting = "API_PROJECT_RATE"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        key = getattr(request, "auth", None)
        if not isinstance(key, ApiKey):
            return None
        return f"throttle_{self.scope}_{key.project_id}"


class AddressThrottle(_CacheThrottle):
    """Requests without a valid key (the schema, a missing or wrong key) get
    ``FP4PREP_API_ADDRESS_RATE`` per client address: the socket's peer, or with
    ``FP4PREP_TRUSTED_PROXIES`` N, the address the Nth proxy from the end saw."""

    scope = "api_address"
    setting = "API_ADDRESS_RATE"
    refused = False  # set by check(): the request's key was refused, so it has none to ask for

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        if not self.refused and isinstance(getattr(request, "auth", None), ApiKey):
            return None
        return self.key_for(client_address(request))

    @classmethod
    def key_for(cls, address: str) -> str:
        return f"throttle_{cls.scope}_{address}"

    @classmethod
    def check(cls, request: Any) -> None:
        """Count a request refused for its key against its address; 429 once past the rate."""
        throttle = cls()
        throttle.refused = True
        if not throttle.allow_request(request, None):
            raise exceptions.Throttled(throttle.wait())
