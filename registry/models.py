"""Projects, API keys, the credit ledger, the model registry and the supported-base catalogue."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q, Sum
from django.utils import timezone

from fp4prep.pipeline.config import RunSettings
from fp4prep.pipeline.formats import choices as format_choices
from fp4prep.site import ids
from fp4prep.site.errors import NotFound
from fp4prep.text import clip

CENT = Decimal("0.01")


def usd(value: Decimal | int | str) -> Decimal:
    return Decimal(value).quantize(CENT, rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class Credit:
    balance: Decimal  # grants and adjustments minus charges
    held: Decimal  # holds not yet charged or released
    available: Decimal


class Project(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=ids.project_id, editable=False)
    name = models.CharField(max_length=100)
    blocked = models.BooleanField(default=False)
    blocked_reason = models.CharField(max_length=200, blank=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="projects", blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    def stored_bytes(self) -> int:
        """What the project's uploads take on the artifact store: adapter revisions and calibration files."""
        adapters = Revision.objects.filter(model__project=self, model__kind=Model.Kind.ADAPTER)
        uploads = adapters.aggregate(total=Sum("size_bytes", default=0))["total"]
        return int(uploads) + int(self.files.aggregate(total=Sum("size_bytes", default=0))["total"])

    def credit(self) -> Credit:
        """The ledger summed in one query."""
        kinds = CreditTransaction.Kind
        totals = self.credit_transactions.aggregate(
            added=Sum("amount", filter=Q(kind__in=[kinds.GRANT, kinds.ADJUSTMENT]), default=Decimal(0)),
            held=Sum("amount", filter=Q(kind=kinds.HOLD), default=Decimal(0)),
            charged=Sum("amount", filter=Q(kind=kinds.CHARGE), default=Decimal(0)),
            released=Sum("amount", filter=Q(kind=kinds.RELEASE), default=Decimal(0)),
        )
        balance = usd(totals["added"] - totals["charged"])
        held = usd(totals["held"] - totals["charged"] - totals["released"])
        return Credit(balance=balance, held=held, available=balance - held)

    def add_credit(self, amount: Decimal, note: str, user: Any = None, kind: str = "adjustment") -> CreditTransaction:
        """A grant or a manual adjustment (negative to take credit away); never an overwrite."""
        return self.credit_transactions.create(kind=kind, amount=usd(amount), note=note, created_by=user)

    def block(self, reason: str = "") -> None:
        self.blocked, self.blocked_reason = True, reason
        self.save(update_fields=["blocked", "blocked_reason"])

    def unblock(self) -> None:
        self.blocked, self.blocked_reason = False, ""
        self.save(update_fields=["blocked", "blocked_reason"])


class CreditTransaction(models.Model):
    """One line of a project's credit ledger. Amounts of holds, charges and releases are positive."""

    class Kind(models.TextChoices):
        GRANT = "grant"
        ADJUSTMENT = "adjustment"
        HOLD = "hold"
        CHARGE = "charge"
        RELEASE = "release"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="credit_transactions")
    kind = models.CharField(max_length=12, choices=Kind.choices)
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    job_id = models.CharField(max_length=40, blank=True, db_index=True)
    note = models.CharField(max_length=200, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.kind} ${self.amount} ({self.project_id})"


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiKey(models.Model):
    """Stored hashed; the key itself is shown once, when created."""

    class Scope(models.TextChoices):
        FULL = "full"  # everything the project may do: upload, spend credit, cancel, make keys
        READ = "read"  # list and fetch only: for dashboards, monitoring and downloads

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    NAME_MAX = 100
    name = models.CharField(max_length=NAME_MAX, blank=True)
    scope = models.CharField(max_length=8, choices=Scope.choices, default=Scope.FULL)
    prefix = models.CharField(max_length=12, editable=False)
    hashed = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or 'unnamed'})"

    @classmethod
    def issue(cls, project: Project, name: str = "", scope: str = Scope.FULL) -> tuple[ApiKey, str]:
        raw = ids.api_key()
        return cls.objects.create(project=project, name=name, scope=scope, prefix=raw[:12], hashed=hash_key(raw)), raw

    @classmethod
    def find(cls, raw: str) -> ApiKey | None:
        return (
            cls.objects.select_related("project").filter(hashed=hash_key(raw), revoked_at__isnull=True).first()
        )

    def revoke(self) -> None:
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])


# What a catalogue entry may fix for the pipeline (fields of fp4prep.pipeline.PipelineConfig).


class SupportedBase(models.Model):
    """A catalogue entry: which adapters can be prepared and how. Data, edited in the admin."""

    class WorkerKind(models.TextChoices):
        GPU = "gpu"
        CPU = "cpu"

    slug = models.CharField(primary_key=True, max_length=60, help_text="A short stable key, e.g. glm-5.3")
    family = models.CharField(max_length=100)
    accepted_base_ids = models.JSONField(help_text="Adapter base IDs this entry accepts")
    served_base_id = models.CharField(max_length=200, help_text="The FP4 base the prepared model is registered against")
    # The catalogue's formats: the 4-bit ones (FP8 is for local runs).
    quantization = models.CharField(max_length=10, choices=[(n, n.upper()) for n in format_choices(bits=(4,))])
    # Fixed run settings (PipelineConfig fields: corpus size, thresholds); users can't change them.
    # The format's recipe itself is the pipeline's, the same for every base.
    run_settings = models.JSONField(default=dict, blank=True)
    user_token_minimum = models.PositiveIntegerField()
    typical_hours = models.DecimalField(max_digits=8, decimal_places=3)
    gpu_count = models.PositiveIntegerField(help_text="0 for a CPU worker")
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4, help_text="USD per GPU-hour (per worker-hour on a CPU worker)")
    worker_kind = models.CharField(max_length=3, choices=WorkerKind.choices)
    class WeightsFormat(models.TextChoices):
        BF16 = "bf16", "BF16"
        FP8_BLOCKS = "fp8-blocks", "FP8 in 128x128 blocks"
        NVFP4 = "nvfp4", "an NVFP4 release"
        MXFP4 = "mxfp4", "an MXFP4 release"

    weights_location = models.CharField(
        max_length=500, help_text="The base's weights: a directory under FP4PREP_WEIGHTS_ROOT, an absolute path, or 'embedded:smollm2'"
    )
    # How the weights there are stored: a worker refuses a job whose weights say otherwise, before any
    # work. An FP4 release is read as it ships; the prepared model keeps its format.
    weights_format = models.CharField(max_length=12, choices=WeightsFormat.choices, default=WeightsFormat.BF16)
    # {"layers": N, "tensors": {"model.layers.*.self_attn.q_proj.weight": [out, in], ...}}: what an
    # uploaded adapter's LoRA matrices are checked against before it is stored. Empty: checked by
    # the job's merge instead. `manage.py baseshapes SLUG` fills it from the weights.
    weight_shapes = models.JSONField(default=dict, blank=True)
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["family"]

    def __str__(self) -> str:
        return self.family

    def price(self) -> Decimal:
        return usd(self.typical_hours * max(self.gpu_count, 1) * self.price_per_gpu_hour)

    def clean(self) -> None:
        """The run settings are ones the pipeline takes (``RunSettings``); anything else can't run."""
        self.check_run_settings()
        if not isinstance(self.accepted_base_ids, list) or not all(isinstance(i, str) and i for i in self.accepted_base_ids):
            raise ValidationError({"accepted_base_ids": "must be a list of base model IDs"})

    def save(self, *args: Any, **kwargs: Any) -> None:
        # Every way a row is written (the admin, the catalogue command, a script) runs the check.
        self.check_run_settings()
        super().save(*args, **kwargs)

    def check_run_settings(self) -> RunSettings:
        try:
            return RunSettings.parse(self.run_settings)
        except ValueError as exc:
            raise ValidationError({"run_settings": str(exc)}) from None

    @classmethod
    def for_base_id(cls, base_id: str) -> SupportedBase | None:
        # A handful of rows: JSON containment isn't portable to SQLite, a Python scan is.
        return next((b for b in cls.objects.filter(active=True) if base_id in b.accepted_base_ids), None)


class DeploymentProfile(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=ids.profile_id, editable=False)
    supported_base = models.ForeignKey(SupportedBase, on_delete=models.CASCADE, related_name="profiles")
    name = models.CharField(max_length=100)
    hardware = models.CharField(max_length=100)
    gpu_count = models.PositiveIntegerField()
    quantization = models.CharField(max_length=10)

    class Meta:
        ordering = ["gpu_count", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class Model(models.Model):
    class Kind(models.TextChoices):
        BASE = "base"
        ADAPTER = "adapter"
        MERGED = "merged"
        FULL = "full"
        PREPARED = "prepared"

    id = models.CharField(primary_key=True, max_length=40, default=ids.model_id, editable=False)
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.CASCADE, related_name="models")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    NAME_MAX = BASE_MODEL_MAX = 200
    name = models.CharField(max_length=NAME_MAX)
    # Adapters: the base ID they were trained on. Prepared models: the FP4 base that serves them.
    base_model = models.CharField(max_length=BASE_MODEL_MAX, blank=True)
    supported_base = models.ForeignKey(SupportedBase, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    source_adapter = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="prepared_models"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [models.Index(fields=["project", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def records_fine_tuning(self) -> bool:
        return self.kind == self.Kind.ADAPTER and bool(self.base_model)

    def latest_revision(self) -> Revision | None:
        return self.revisions.order_by("-number").first()

    def deployment_profiles(self) -> models.QuerySet[DeploymentProfile]:
        if self.supported_base_id is None:
            return DeploymentProfile.objects.none()
        return DeploymentProfile.objects.filter(supported_base_id=self.supported_base_id)


def get_model(project: Project, model_id: str, among: models.QuerySet[Model] | None = None) -> Model:
    """The project's model or a public one; anything else is 'does not exist in this project'.
    ``among`` (e.g. with its relations prefetched) is where to look, all models by default."""
    found = (Model.objects.all() if among is None else among).filter(Q(project=project) | Q(project__isnull=True), pk=model_id).first()
    if found is None:
        raise NotFound(f"model {clip(model_id, 60)} does not exist in this project", code="model_not_found")
    return found


def get_revision(model: Model, revision_id: str) -> Revision:
    found = model.revisions.filter(pk=revision_id).first()
    if found is None:
        raise NotFound(f"revision {clip(revision_id, 60)} of model {model.id} does not exist", code="revision_not_found")
    return found


class Revision(models.Model):
    """An immutable directory of files; its sha256 covers every file's path and content."""

    id = models.CharField(primary_key=True, max_length=40, default=ids.revision_id, editable=False)
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="revisions")
    number = models.PositiveIntegerField()
    path = models.CharField(max_length=500, help_text="Relative to FP4PREP_ARTIFACT_ROOT")
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    files = models.JSONField(default=list)  # [{"path", "size", "sha256"}]
    metadata = models.JSONField(default=dict, blank=True)
    job_id = models.CharField(max_length=40, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model", "-number"]
        constraints = [models.UniqueConstraint(fields=["model", "number"], name="revision_number_unique")]

    def __str__(self) -> str:
        return f"{self.model_id} #{self.number} ({self.id})"

    @property
    def directory(self) -> Path:
        return settings.ARTIFACT_ROOT / self.path


# Prefetch a model's revisions newest first (what lists and detail views show).
NEWEST_FIRST = models.Prefetch("revisions", queryset=Revision.objects.order_by("-number"))
