"""Support staff's console for projects, credit, keys, the registry and the catalogue."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.models import LogEntry
from django.db.models import Model as DjangoModel
from django.db.models import QuerySet
from django.http import HttpRequest

from .models import ApiKey, CreditTransaction, DeploymentProfile, Model, Project, Revision, SupportedBase


class ReasonActionForm(ActionForm):
    reason = forms.CharField(required=False, label="Reason", widget=forms.TextInput(attrs={"size": 40, "placeholder": "why (kept in the log)"}))


class LoggedActions(admin.ModelAdmin):
    """Actions that change customers' things need a reason; who did what and why goes to the admin log."""

    action_form = ReasonActionForm

    def reason(self, request: HttpRequest) -> str:
        reason = str(request.POST.get("reason", "")).strip()
        if not reason:
            self.message_user(request, "Say why in the Reason box: the admin log keeps who did it and why.", messages.ERROR)
        return reason[:200]

    def log(self, request: HttpRequest, obj: DjangoModel, what: str, reason: str) -> None:
        self.log_change(request, obj, f"{what}: {reason}")


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class LedgerInline(ReadOnlyInline):
    model = CreditTransaction
    fields = ["created_at", "kind", "amount", "job_id", "note", "created_by"]
    readonly_fields = fields
    ordering = ["-created_at", "-id"]
    show_change_link = False
    verbose_name_plural = "Credit ledger (add an adjustment under Credit transactions)"


class ApiKeyInline(ReadOnlyInline):
    model = ApiKey
    fields = ["prefix", "name", "scope", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = fields


@admin.register(Project)
class ProjectAdmin(LoggedActions):
    list_display = ["name", "id", "blocked", "balance", "held", "created_at"]
    list_filter = ["blocked"]
    search_fields = ["id", "name", "members__username"]
    fields = ["id", "name", "members", "blocked", "blocked_reason", "balance", "held", "created_at"]
    readonly_fields = ["id", "blocked", "blocked_reason", "balance", "held", "created_at"]
    filter_horizontal = ["members"]
    inlines = [ApiKeyInline, LedgerInline]
    actions = ["block", "unblock"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Membership is access to a customer's data and keys: only superusers change it.
        if request.user.is_superuser:  # type: ignore[union-attr]
            return self.readonly_fields
        return [*self.readonly_fields, "name", "members"]

    @admin.display(description="balance (USD)")
    def balance(self, project: Project) -> Any:
        return project.credit().balance

    @admin.display(description="held (USD)")
    def held(self, project: Project) -> Any:
        return project.credit().held

    @admin.action(description="Block selected projects from starting jobs", permissions=["change"])
    def block(self, request: HttpRequest, queryset: QuerySet[Project]) -> None:
        if not (reason := self.reason(request)):
            return
        for project in queryset:
            project.block(f"{reason}; blocked by {request.user}")
            self.log(request, project, "Blocked", reason)
        self.message_user(request, f"Blocked {queryset.count()} project(s).", messages.SUCCESS)

    @admin.action(description="Unblock selected projects", permissions=["change"])
    def unblock(self, request: HttpRequest, queryset: QuerySet[Project]) -> None:
        if not (reason := self.reason(request)):
            return
        for project in queryset:
            project.unblock()
            self.log(request, project, "Unblocked", reason)
        self.message_user(request, f"Unblocked {queryset.count()} project(s).", messages.SUCCESS)


class AdjustmentForm(forms.ModelForm):
    kind = forms.ChoiceField(
        choices=[(CreditTransaction.Kind.ADJUSTMENT, "adjustment"), (CreditTransaction.Kind.GRANT, "grant")]
    )

    class Meta:
        model = CreditTransaction
        fields = ["project", "kind", "amount", "note"]

    def clean_note(self) -> str:
        note = self.cleaned_data["note"].strip()
        if not note:
            raise forms.ValidationError("Say why: the ledger keeps the reason with the amount.")
        return note


@admin.register(CreditTransaction)
class CreditTransactionAdmin(admin.ModelAdmin):
    """The ledger: support adds grants and adjustments (negative to take credit away); nothing is edited."""

    form = AdjustmentForm
    list_display = ["created_at", "project", "kind", "amount", "job_id", "note", "created_by"]
    list_filter = ["kind"]
    search_fields = ["project__id", "project__name", "job_id", "note"]
    autocomplete_fields = ["project"]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: CreditTransaction, form: Any, change: bool) -> None:
        obj.created_by = request.user
        super().save_model(request, obj, form, change)


@admin.register(ApiKey)
class ApiKeyAdmin(LoggedActions):
    list_display = ["prefix", "name", "scope", "project", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["scope", "revoked_at"]
    search_fields = ["prefix", "name", "project__id", "project__name"]
    readonly_fields = ["project", "prefix", "name", "scope", "created_at", "last_used_at", "revoked_at"]
    fields = readonly_fields
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # keys are issued to their owners, who see them once

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        if not (reason := self.reason(request)):
            return
        for key in queryset.filter(revoked_at__isnull=True):
            key.revoke()
            self.log(request, key, "Revoked", reason)
        self.message_user(request, "Revoked.", messages.SUCCESS)


class RevisionInline(ReadOnlyInline):
    model = Revision
    fields = ["id", "number", "size_bytes", "sha256", "job_id", "created_at"]
    readonly_fields = fields
    ordering = ["-number"]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "kind", "project", "base_model", "created_at"]
    list_filter = ["kind", "supported_base"]
    search_fields = ["id", "name", "project__id", "base_model"]
    readonly_fields = ["id", "project", "kind", "name", "base_model", "supported_base", "source_adapter", "created_at"]
    fields = readonly_fields
    inlines = [RevisionInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(Revision)
class RevisionAdmin(admin.ModelAdmin):
    list_display = ["id", "model", "number", "size_bytes", "created_at"]
    search_fields = ["id", "model__id", "job_id"]
    readonly_fields = ["id", "model", "number", "path", "size_bytes", "sha256", "files", "metadata", "job_id", "created_at"]
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ProfileInline(admin.TabularInline):
    model = DeploymentProfile
    extra = 0


@admin.register(SupportedBase)
class SupportedBaseAdmin(admin.ModelAdmin):
    list_display = ["family", "slug", "quantization", "worker_kind", "typical_hours", "gpu_count", "price_per_gpu_hour", "price", "active"]
    list_filter = ["worker_kind", "quantization", "active"]
    inlines = [ProfileInline]

    @admin.display(description="price (USD)")
    def price(self, base: SupportedBase) -> Any:
        return base.price()


@admin.register(LogEntry)
class LogEntryAdmin(admin.ModelAdmin):
    """The admin log, read-only: who changed what in the console, and why."""

    list_display = ["action_time", "user", "content_type", "object_repr", "change_message"]
    list_filter = ["content_type"]
    search_fields = ["object_repr", "object_id", "change_message", "user__username"]
    readonly_fields = ["action_time", "user", "content_type", "object_id", "object_repr", "action_flag", "change_message"]
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
