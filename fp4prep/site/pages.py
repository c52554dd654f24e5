"""What every dashboard page shares: the project in the URL, checked against the signed-in user.

A page URL names its project (``/projects/<id>/...``). The view gets the project only if the user
is a member; anything else, and any object of another project, is a 404 -- never a hint that it
exists. Service errors from the verbs the API also uses become the same messages on the page.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import wraps
from typing import Any, Concatenate, ParamSpec

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.utils.functional import SimpleLazyObject
from django.views.debug import SafeExceptionReporterFilter
from django.views.decorators.csrf import csrf_exempt, csrf_protect

from fp4prep.site.errors import NotFound
from fp4prep.site.middleware import takes_uploads
from fp4prep.site.rest import limit_uploads, uploaded_file
from registry.models import Project

P = ParamSpec("P")
PAGE_SIZE = 25
SESSION_PROJECT = "project_id"

ProjectView = Callable[Concatenate[HttpRequest, Project, P], HttpResponse]


class SettingsFilter(SafeExceptionReporterFilter):
    """Django's filter hides settings named like keys and passwords; ours hides database and broker
    URLs too (``postgres://user:password@…``, ``redis://:password@…``)."""

    hidden_settings = re.compile("API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|URL|DATABASE|Q_CLUSTER|CACHES", flags=re.I)


def member_projects(user: Any) -> QuerySet[Project]:
    return Project.objects.filter(members=user).order_by("name", "id")


def project_page(view: ProjectView[P]) -> Callable[Concatenate[HttpRequest, str, P], HttpResponse]:
    """Sign-in required; the URL's project must be one of the user's; NotFound becomes a 404."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, project_id: str, *args: P.args, **kwargs: P.kwargs) -> HttpResponse:
        project = member_projects(request.user).filter(pk=project_id).first()
        if project is None:
            raise Http404("No such project")
        if request.session.get(SESSION_PROJECT) != project.id:
            request.session[SESSION_PROJECT] = project.id  # where "/" takes the user next time
        request.project = project  # type: ignore[attr-defined]  # for the layout's header
        try:
            return view(request, project, *args, **kwargs)
        except NotFound as exc:
            raise Http404(exc.message) from None

    return wrapper


def upload_page(limit_setting: str) -> Callable[[ProjectView[P]], Callable[Concatenate[HttpRequest, str, P], HttpResponse]]:
    """A project page that takes a file upload of at most ``settings.<limit_setting>`` bytes.

    The size-limited handlers must be in place before anything reads the body, and the CSRF check
    reads it: so the view is exempt from the middleware and checks CSRF after installing them.
    """

    def decorate(view: ProjectView[P]) -> Callable[Concatenate[HttpRequest, str, P], HttpResponse]:
        protected = csrf_protect(view)

        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest, project: Project, *args: P.args, **kwargs: P.kwargs) -> HttpResponse:
            limit = getattr(settings, limit_setting)
            request.upload_limit = (limit, limit_uploads(request, limit))  # type: ignore[attr-defined]
            return protected(request, project, *args, **kwargs)

        return takes_uploads(project_page(wrapper))

    return decorate


def upload(request: HttpRequest, field: str, what: str) -> Any:
    """The file an upload_page received, or a ServiceError (missing, too large) to show on the page."""
    limit, limiter = request.upload_limit  # type: ignore[attr-defined]
    return uploaded_file(request, field, limit, what, limiter)


def paginate(request: HttpRequest, rows: QuerySet[Any]) -> Page:
    return Paginator(rows, PAGE_SIZE).get_page(request.GET.get("page"))


def context(request: HttpRequest) -> dict[str, Any]:
    """The layout's project switcher and credit, queried only by pages that show them."""
    project: Project | None = getattr(request, "project", None)
    user = getattr(request, "user", None)
    return {
        "project": project,
        "my_projects": SimpleLazyObject(lambda: list(member_projects(user)) if user and user.is_authenticated else []),
        "credit": SimpleLazyObject(lambda: project.credit() if project else None),
    }
