"""How the registry's objects read in the REST API: models, revisions and their files, deployment profiles."""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .models import ApiKey, DeploymentProfile, Model, Revision


class RevisionFileSerializer(serializers.Serializer):
    path = serializers.CharField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()


class RevisionSerializer(serializers.ModelSerializer):
    model_id = serializers.CharField(read_only=True)
    files = RevisionFileSerializer(many=True, read_only=True)
    download_url = serializers.SerializerMethodField()

    class Meta:
        model = Revision
        fields = ["id", "model_id", "number", "size_bytes", "sha256", "files", "metadata", "job_id", "created_at", "download_url"]

    def get_download_url(self, revision: Revision) -> str:
        return reverse("api-revision-download", args=[revision.model_id, revision.id])


class ModelSerializer(serializers.ModelSerializer):
    project_id = serializers.CharField(read_only=True, allow_null=True)
    source_adapter_id = serializers.CharField(read_only=True, allow_null=True)
    supported_base = serializers.CharField(source="supported_base.family", read_only=True, allow_null=True, default=None)
    latest_revision = serializers.SerializerMethodField()

    class Meta:
        model = Model
        fields = [
            "id", "kind", "name", "base_model", "project_id", "supported_base", "source_adapter_id",
            "created_at", "latest_revision",
        ]

    @extend_schema_field(RevisionSerializer(allow_null=True))
    def get_latest_revision(self, model: Model) -> dict[str, Any] | None:
        # Views prefetch revisions newest first: no query per model.
        revisions = list(model.revisions.all())
        return RevisionSerializer(revisions[0]).data if revisions else None


class DeploymentProfileSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeploymentProfile
        fields = ["id", "name", "hardware", "gpu_count", "quantization"]


class RegisterAdapterSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="A .tar.gz, .tar or .zip of a PEFT LoRA adapter directory")
    base_model = serializers.CharField(help_text="The adapter base ID the adapter was trained on")
    name = serializers.CharField(required=False, allow_blank=True)
    model_id = serializers.CharField(required=False, allow_blank=True, help_text="Add a revision to this adapter")


class LimitsSerializer(serializers.Serializer):
    calibration_file_bytes = serializers.IntegerField(help_text="the largest calibration file an upload takes")
    adapter_archive_bytes = serializers.IntegerField(help_text="the largest adapter archive (unpacked) an upload takes")


class ApiKeySerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    name = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")
    scope = serializers.ChoiceField(choices=ApiKey.Scope.choices, default=ApiKey.Scope.FULL)
    prefix = serializers.CharField(read_only=True)
    created_at = serializers.DateTimeField(read_only=True)
    last_used_at = serializers.DateTimeField(read_only=True, allow_null=True)
    revoked_at = serializers.DateTimeField(read_only=True, allow_null=True)


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself: shown only in this answer")


class ProjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    key_scope = serializers.CharField(help_text="The scope of the key that asks: full or read")
    name = serializers.CharField()
    blocked = serializers.BooleanField()
    balance_usd = serializers.FloatField()
    held_usd = serializers.FloatField()
    available_usd = serializers.FloatField()
    limits = LimitsSerializer()
