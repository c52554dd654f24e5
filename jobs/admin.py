"""Support staff's console for jobs (with their events), calibration files and workers."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from fp4prep.site.errors import ServiceError
from registry.admin import LoggedActions

from . import services
from .models import CalibrationFile, Job, JobEvent, Worker


class EventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = ["created_at", "type", "level", "message", "data"]
    readonly_fields = fields
    ordering = ["id"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(LoggedActions):
    list_display = ["id", "project", "status", "stage", "progress_percent", "supported_base", "worker", "requeued_as", "created_at"]
    list_filter = ["status", "supported_base", "supported_base__worker_kind", "created_at"]
    search_fields = ["id", "project__id", "project__name", "adapter__id", "worker"]
    list_select_related = ["project", "supported_base"]
    date_hierarchy = "created_at"
    inlines = [EventInline]
    actions = ["cancel", "requeue"]
    readonly_fields = [f.name for f in Job._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="progress")
    def progress_percent(self, job: Job) -> str:
        return f"{job.progress:.0%}" if job.status == Job.Status.RUNNING else ""

    @admin.action(description="Cancel selected jobs", permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        if not (reason := self.reason(request)):
            return
        for job in queryset.select_related("project"):
            try:
                services.request_cancel(job.project, job.id)
                self.log(request, job, "Cancelled", reason)
                self.message_user(request, f"Job {job.id}: cancellation requested.", messages.SUCCESS)
            except ServiceError as exc:
                self.message_user(request, exc.message, messages.WARNING)

    @admin.action(description="Requeue selected jobs (a new job with the same inputs)", permissions=["change"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        if not (reason := self.reason(request)):
            return
        for job in queryset.select_related("project"):
            try:
                new = services.requeue(job)
                self.log(request, job, f"Requeued as {new.id}", reason)
                self.message_user(request, f"Job {job.id}: requeued as {new.id}.", messages.SUCCESS)
            except ServiceError as exc:
                expected = exc.code in ("not_requeueable", "already_requeued")
                self.message_user(request, exc.message if expected else f"Job {job.id}: {exc.message}", messages.WARNING if expected else messages.ERROR)


@admin.register(CalibrationFile)
class CalibrationFileAdmin(admin.ModelAdmin):
    list_display = ["id", "filename", "project", "status", "size_bytes", "created_at"]
    list_filter = ["status"]
    search_fields = ["id", "filename", "project__id", "sha256"]
    readonly_fields = [f.name for f in CalibrationFile._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "slots", "started_at", "last_seen"]
    list_filter = ["kind"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
