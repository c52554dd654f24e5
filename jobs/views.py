"""Dashboard pages of jobs: the list, the live job page, prepare (estimate, create) and calibration files.

The verbs are the API's (jobs.services); these views only turn forms into their inputs and their
errors into messages on the page.
"""

from __future__ import annotations

import uuid
from decimal import Decimal, InvalidOperation
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_POST
from django_htmx.http import HttpResponseClientRedirect, HttpResponseStopPolling

from fp4prep.pipeline.validation import report as quality
from fp4prep.site.errors import NotFound, ServiceError
from fp4prep.site.pages import paginate, project_page, upload, upload_page
from registry.models import Model, Project

from . import calibration, services
from .models import STAGE_MESSAGES, CalibrationFile, Job, get_file, get_job

FILTERS = {
    "active": ("Active", [Job.Status.PENDING, Job.Status.QUEUED, Job.Status.RUNNING, Job.Status.CANCEL_REQUESTED]),
    "completed": ("Completed", [Job.Status.COMPLETED]),
    "failed": ("Failed", [Job.Status.ERROR, Job.Status.USER_ERROR]),
    "cancelled": ("Cancelled", [Job.Status.CANCELLED]),
}
STAGES = tuple(STAGE_MESSAGES)  # the worker's stages, in order: the pipeline's, then uploading


@project_page
def job_list(request: HttpRequest, project: Project) -> HttpResponse:
    jobs = Job.objects.filter(project=project).select_related("adapter", "supported_base").order_by("-created_at", "-id")
    selected = request.GET.get("status", "")
    if selected not in FILTERS:
        selected = ""
    if selected:
        jobs = jobs.filter(status__in=FILTERS[selected][1])
    filters = [("", "All")] + [(key, label) for key, (label, _) in FILTERS.items()]
    context = {"page": paginate(request, jobs), "filters": filters, "selected": selected,
               "page_query": f"status={selected}&" if selected else ""}
    return render(request, "jobs/jobs.html", context)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{max(int(seconds), 1)} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def _job_context(project: Project, job_id: str, **extra: Any) -> dict[str, Any]:
    related = ("adapter", "adapter_revision", "calibration_file", "supported_base", "result_model", "result_revision")
    job = get_job(project, job_id, Job.objects.select_related(*related))
    report = job.report or {}
    current = STAGES.index(job.stage) if job.stage in STAGES else -1
    stages = [
        {"name": s, "state": "done" if i < current or job.status == Job.Status.COMPLETED else "now" if i == current else "todo"}
        for i, s in enumerate(STAGES)
    ]
    return {
        "job": job,
        "events": list(job.events.order_by("id")),
        "eta_text": _duration(job.eta_seconds()),
        "run_text": _duration((job.finished_at - job.started_at).total_seconds()) if job.finished_at and job.started_at else "",
        "stages": stages,
        "chart": quality.chart(report),
        "figures": quality.figures(report),
        "cancellable": job.status in Job.CANCELLABLE,
        **extra,
    }


@project_page
def job_detail(request: HttpRequest, project: Project, job_id: str) -> HttpResponse:
    return render(request, "jobs/job.html", _job_context(project, job_id))


@project_page
def job_live(request: HttpRequest, project: Project, job_id: str, **extra: Any) -> HttpResponse:
    """The polled part of the job page; once the job has ended, htmx is told to stop polling."""
    context = _job_context(project, job_id, **extra)
    html = render_to_string("jobs/job.html#live", context, request)
    if context["job"].is_terminal:
        return HttpResponseStopPolling(html)
    return HttpResponse(html)


@require_POST
@project_page
def job_cancel(request: HttpRequest, project: Project, job_id: str) -> HttpResponse:
    try:
        job = services.request_cancel(project, job_id)
    except NotFound:
        raise
    except ServiceError as exc:
        context = _job_context(project, job_id, cancel_error=exc.message)
        if request.htmx:
            return HttpResponse(render_to_string("jobs/job.html#live", context, request))
        return render(request, "jobs/job.html", context, status=409)
    if not request.htmx:
        return redirect("job", project.id, job_id)
    # The job as this request left it (cancel_requested), so the page shows that step even when
    # the worker ends the job a moment later; the next poll shows the end.
    context = _job_context(project, job_id)
    context.update(job=job, cancellable=False)
    return HttpResponse(render_to_string("jobs/job.html#live", context, request))


# --- Prepare: choose, estimate, confirm, create -----------------------------------------------------


def _prepare_context(request: HttpRequest, project: Project, data: Any, **extra: Any) -> dict[str, Any]:
    adapters = list(
        Model.objects.filter(project=project, kind=Model.Kind.ADAPTER).select_related("supported_base").order_by("-created_at", "id")
    )
    chosen_id = data.get("adapter", "") or (adapters[0].id if adapters else "")
    chosen = next((a for a in adapters if a.id == chosen_id), None)
    revisions = list(chosen.revisions.order_by("-number")) if chosen else []
    files = CalibrationFile.objects.filter(project=project, status=CalibrationFile.Status.PROCESSED).order_by("-created_at", "id")[:50]
    return {
        "adapters": adapters,
        "chosen": chosen,
        "revisions": revisions,
        "revision_id": data.get("revision", ""),
        "files": files,
        "file_id": data.get("calibration_file", ""),
        **extra,
    }


def _inputs(data: Any) -> dict[str, Any]:
    return {
        "adapter_object_id": data.get("adapter", ""),
        "adapter_revision_id": data.get("revision", "") or None,
        "calibration_file_id": data.get("calibration_file", "") or None,
    }


@project_page
def prepare(request: HttpRequest, project: Project) -> HttpResponse:
    context = _prepare_context(request, project, request.GET)
    if request.htmx and request.htmx.target == "revision-field":
        return render(request, "jobs/prepare.html#revision-field", context)
    return render(request, "jobs/prepare.html", context)


def _estimate_response(request: HttpRequest, project: Project, status: int = 200, **extra: Any) -> HttpResponse:
    context = _prepare_context(request, project, request.POST, **extra)
    if extra.get("estimate"):
        context["time_text"] = _duration(float(extra["estimate"].time_hours) * 3600)
        # The confirmation form's key: a double submit of it creates one job.
        context["idempotency_key"] = uuid.uuid4().hex
    template = "jobs/prepare.html#estimate" if request.htmx else "jobs/prepare.html"
    return render(request, template, context, status=status)


@require_POST
@project_page
def prepare_estimate(request: HttpRequest, project: Project) -> HttpResponse:
    try:
        estimate = services.estimate(project, _inputs(request.POST))
    except ServiceError as exc:
        return _estimate_response(request, project, status=exc.status, estimate_error=exc.message)
    return _estimate_response(request, project, estimate=estimate)


@require_POST
@project_page
def prepare_create(request: HttpRequest, project: Project) -> HttpResponse:
    """Creates only at the price the user confirmed; a changed price shows the new estimate instead."""
    inputs = _inputs(request.POST)
    try:
        estimate = services.estimate(project, inputs)
        try:
            confirmed = Decimal(request.POST.get("confirm_price", ""))
        except InvalidOperation:
            confirmed = None
        if confirmed != estimate.price_usd:
            return _estimate_response(
                request, project, status=409, estimate=estimate,
                estimate_error=f"Confirm the price first: the job costs ${estimate.price_usd}.",
            )
        job = services.create_job(project, inputs, idempotency_key=request.POST.get("idempotency_key", ""))
    except ServiceError as exc:
        return _estimate_response(request, project, status=exc.status, estimate_error=exc.message)
    target = reverse("job", args=[project.id, job.id])
    return HttpResponseClientRedirect(target) if request.htmx else redirect(target)


# --- Calibration files ------------------------------------------------------------------------------


@upload_page("CALIBRATION_MAX_BYTES")
def files(request: HttpRequest, project: Project) -> HttpResponse:
    """The list, and uploads: from this page (then the file's report) or from the prepare page,
    whose calibration field comes back with the report inline and the file chosen if it passed."""
    uploaded, error = None, ""
    if request.method == "POST":
        try:
            received = upload(request, "file", "The calibration file")
            with received.open("rb") as stream:
                uploaded = calibration.store(project, stream, received.name or "calibration.jsonl")
        except ServiceError as exc:
            error = exc.message
    if request.htmx and request.htmx.target == "calibration-field":
        chosen = uploaded.id if uploaded and uploaded.status == CalibrationFile.Status.PROCESSED else ""
        context = _prepare_context(request, project, {"calibration_file": chosen}, uploaded=uploaded, upload_error=error)
        return render(request, "jobs/prepare.html#calibration-field", context, status=400 if error else 200)
    if uploaded is not None:
        return redirect("file", project.id, uploaded.id)
    rows = CalibrationFile.objects.filter(project=project).order_by("-created_at", "id")
    return render(request, "jobs/files.html", {"page": paginate(request, rows), "upload_error": error}, status=400 if error else 200)


@project_page
def file_detail(request: HttpRequest, project: Project, file_id: str) -> HttpResponse:
    record = get_file(project, file_id)
    jobs = record.jobs.select_related("adapter").order_by("-created_at")[:20]
    return render(request, "jobs/file.html", {"file": record, "jobs": jobs})
