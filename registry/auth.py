"""API keys as bearer tokens: each request acts for the key's project and sees only that project."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from .models import ApiKey, Project


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
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <api key>'")
        key = ApiKey.find(raw.strip())
        if key is None:
            raise exceptions.AuthenticationFailed("API key is not valid or was revoked")
        now = timezone.now()
        if key.last_used_at is None or now - key.last_used_at > timedelta(minutes=5):
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)  # coarse, so reads stay reads
        return ProjectPrincipal(key.project), key

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="fp4prep"'


class HasProject(permissions.BasePermission):
    def has_permission(self, request: Any, view: Any) -> bool:
        if not isinstance(request.user, ProjectPrincipal):
            raise exceptions.NotAuthenticated("Send your API key: 'Authorization: Bearer <api key>'")
        return True


def project_of(request: Any) -> Project:
    return request.user.project
