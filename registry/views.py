"""Dashboard pages of the registry: sign-in landing, API keys, adapters, models and revisions."""

from __future__ import annotations

from pathlib import Path

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST
from django_htmx.http import HttpResponseClientRedirect

from fp4prep.pipeline.validation import report as quality
from fp4prep.site.errors import InvalidInput, NotFound, ServiceError, check_length
from fp4prep.site.pages import SESSION_PROJECT, member_projects, paginate, project_page, upload, upload_page
from fp4prep.text import excerpt

from . import artifacts, services, serving
from .models import NEWEST_FIRST, ApiKey, Model, Project, SupportedBase, get_model, get_revision


@login_required
def home(request: HttpRequest) -> HttpResponse:
    """The project the user last looked at, else their first; a page that says so when there is none."""
    projects = member_projects(request.user)
    project = projects.filter(pk=request.session.get(SESSION_PROJECT, "")).first() or projects.first()
    if project is None:
        return render(request, "registry/no_project.html")
    return redirect("jobs", project.id)


@project_page
def keys(request: HttpRequest, project: Project) -> HttpResponse:
    new_key, error = None, ""
    if request.method == "POST":
        try:
            name = check_length("name", request.POST.get("name", "").strip(), ApiKey.NAME_MAX)
            scope = request.POST.get("scope", ApiKey.Scope.FULL)
            if scope not in ApiKey.Scope.values:
                raise InvalidInput(f"scope: one of {', '.join(ApiKey.Scope.values)}, not {excerpt(scope)}")
            _, new_key = ApiKey.issue(project, name, scope)
        except ServiceError as exc:
            error = exc.message
    page = paginate(request, project.api_keys.order_by("revoked_at", "-created_at"))
    return render(request, "registry/keys.html", {"page": page, "new_key": new_key, "error": error}, status=400 if error else 200)


@require_POST
@project_page
def revoke_key(request: HttpRequest, project: Project, key_id: int) -> HttpResponse:
    key = project.api_keys.filter(pk=key_id, revoked_at__isnull=True).first()
    if key is None:
        raise NotFound(f"API key {key_id} not found")
    key.revoke()
    return redirect("keys", project.id)


def _adapters(request: HttpRequest, project: Project, **context: object) -> HttpResponse:
    adapters = (
        Model.objects.filter(project=project, kind=Model.Kind.ADAPTER)
        .select_related("supported_base")
        .prefetch_related(NEWEST_FIRST)
        .order_by("-created_at", "id")
    )
    prepared = (
        Model.objects.filter(project=project, kind=Model.Kind.PREPARED)
        .select_related("source_adapter")
        .prefetch_related(NEWEST_FIRST)
        .order_by("-created_at", "id")[:50]
    )
    bases = [b for entry in SupportedBase.objects.filter(active=True) for b in entry.accepted_base_ids]
    status = 400 if context.get("error") else 200
    template = "registry/adapters.html#register" if request.htmx else "registry/adapters.html"
    return render(request, template, {"page": paginate(request, adapters), "prepared": prepared, "bases": bases, **context}, status=status)


@upload_page("ADAPTER_MAX_BYTES")
def adapters(request: HttpRequest, project: Project) -> HttpResponse:
    if request.method != "POST":
        return _adapters(request, project)
    form = {k: request.POST.get(k, "").strip() for k in ("name", "base_model", "model_id")}
    try:
        archive = upload(request, "file", "The adapter archive")
        model, _ = services.register_adapter(
            project,
            Path(archive.temporary_file_path()),
            base_model=form["base_model"],
            name=form["name"],
            model_id=form["model_id"] or None,
        )
    except ServiceError as exc:
        return _adapters(request, project, error=exc.message, form=form)
    target = reverse("model", args=[project.id, model.id])
    return HttpResponseClientRedirect(target) if request.htmx else redirect(target)


@project_page
def model_detail(request: HttpRequest, project: Project, model_id: str) -> HttpResponse:
    model = get_model(project, model_id, Model.objects.select_related("supported_base", "source_adapter").prefetch_related(NEWEST_FIRST))
    # The jobs that prepared this adapter or produced this model, through the jobs app's relations.
    jobs = (model.jobs.all() | model.produced_by.all()).filter(project=project).distinct().order_by("-created_at")[:20]
    prepared = model.prepared_models.filter(project=project).order_by("-created_at") if model.kind == Model.Kind.ADAPTER else []
    return render(
        request,
        "registry/model.html",
        {"model": model, "profiles": model.deployment_profiles(), "jobs": jobs, "prepared": prepared},
    )


@project_page
def revision_detail(request: HttpRequest, project: Project, model_id: str, revision_id: str) -> HttpResponse:
    model = get_model(project, model_id)
    revision = get_revision(model, revision_id)
    api_root = request.build_absolute_uri("/")
    return render(
        request,
        "registry/revision.html",
        {
            "model": model,
            "revision": revision,
            "commands": serving.commands(model, revision, api_root),
            "figures": quality.figures(revision.metadata.get("report") or {}),
        },
    )


@project_page
def revision_download(request: HttpRequest, project: Project, model_id: str, revision_id: str) -> HttpResponse:
    model = get_model(project, model_id)
    revision = get_revision(model, revision_id)
    return artifacts.download_response(revision)
