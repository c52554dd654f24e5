"""How the jobs app's objects read in the REST API: calibration files with their reports, jobs, events."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .models import CalibrationFile, Job, JobEvent


class LineErrorSerializer(serializers.Serializer):
    line = serializers.IntegerField()
    message = serializers.CharField()


class ReportSerializer(serializers.Serializer):
    conversations = serializers.IntegerField()
    error_count = serializers.IntegerField()
    errors = LineErrorSerializer(many=True)
    summary = serializers.CharField()


class FileSerializer(serializers.ModelSerializer):
    report = ReportSerializer(read_only=True)

    class Meta:
        model = CalibrationFile
        fields = ["id", "purpose", "filename", "size_bytes", "sha256", "status", "report", "created_at"]


class FileUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="JSONL, one conversation per line, at most 64 MiB")
    purpose = serializers.ChoiceField(choices=["calibration"])


class InputsSerializer(serializers.Serializer):
    adapter_object_id = serializers.CharField()
    adapter_revision_id = serializers.CharField(required=False, allow_null=True, allow_blank=True)
    calibration_file_id = serializers.CharField(required=False, allow_null=True, allow_blank=True)


class JobRequestSerializer(serializers.Serializer):
    inputs = InputsSerializer()


class EstimateSerializer(serializers.Serializer):
    price_usd = serializers.FloatField()
    time_hours = serializers.FloatField()
    allowed_to_proceed = serializers.BooleanField()
    reason = serializers.CharField(help_text="Why the job can't proceed; empty when it can")
    balance_usd = serializers.FloatField()
    held_usd = serializers.FloatField()
    available_usd = serializers.FloatField()
    base_model = serializers.CharField()
    quantization = serializers.CharField()
    adapter_object_id = serializers.CharField()
    adapter_revision_id = serializers.CharField()
    calibration_file_id = serializers.CharField(allow_null=True)


class ResultsSerializer(serializers.Serializer):
    api_model_object_id = serializers.CharField()
    api_model_revision_id = serializers.CharField()


_DATETIME = serializers.DateTimeField()


def _datetime(value: Any) -> str | None:
    return _DATETIME.to_representation(value) if value is not None else None


class JobSerializer(serializers.ModelSerializer):
    inputs = serializers.SerializerMethodField()
    base_model = serializers.CharField(source="supported_base.family")
    quantization = serializers.CharField(source="supported_base.quantization")
    eta_seconds = serializers.FloatField(allow_null=True)
    results = serializers.SerializerMethodField()
    estimate = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id", "status", "stage", "progress", "eta_seconds", "inputs", "base_model", "quantization",
            "estimate", "results", "worker", "created_at", "queued_at", "started_at", "finished_at",
        ]

    def to_representation(self, job: Job) -> dict[str, Any]:
        """The fields above, built directly: DRF's field-by-field walk costs most of a list's time
        under polling load. A test holds it equal to DRF's own representation."""
        return {
            "id": job.id,
            "status": job.status,
            "stage": job.stage,
            "progress": job.progress,
            "eta_seconds": job.eta_seconds(),
            "inputs": self.get_inputs(job),
            "base_model": job.supported_base.family,
            "quantization": job.supported_base.quantization,
            "estimate": self.get_estimate(job),
            "results": self.get_results(job),
            "worker": job.worker,
            **{name: _datetime(getattr(job, name)) for name in ("created_at", "queued_at", "started_at", "finished_at")},
        }

    @extend_schema_field(InputsSerializer)
    def get_inputs(self, job: Job) -> dict[str, Any]:
        return {
            "adapter_object_id": job.adapter_id,
            "adapter_revision_id": job.adapter_revision_id,
            "calibration_file_id": job.calibration_file_id,
        }

    @extend_schema_field(ResultsSerializer(allow_null=True))
    def get_results(self, job: Job) -> dict[str, Any] | None:
        if job.status != Job.Status.COMPLETED:
            return None
        return {"api_model_object_id": job.result_model_id, "api_model_revision_id": job.result_revision_id}

    @extend_schema_field({"type": "object", "properties": {"price_usd": {"type": "number"}, "time_hours": {"type": "number"}}})
    def get_estimate(self, job: Job) -> dict[str, Any]:
        return {"price_usd": float(job.price_usd), "time_hours": float(job.time_hours)}


class JobDetailSerializer(JobSerializer):
    report = serializers.JSONField(help_text="The pipeline's measurements once completed: parity, retention, task, sizes")

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "report"]

    def to_representation(self, job: Job) -> dict[str, Any]:
        return {**super().to_representation(job), "report": job.report}


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobEvent
        fields = ["id", "created_at", "type", "level", "message", "data"]


class EventListSerializer(serializers.Serializer):
    data = EventSerializer(many=True)
