"""REST endpoints of the registry: models, revisions, downloads, deployment profiles, whoami."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from fp4prep.site.middleware import takes_uploads
from fp4prep.site.rest import uploaded_file

from . import artifacts, services
from .auth import project_of
from .models import NEWEST_FIRST, ApiKey, Model, get_model, get_revision
from .serializers import (
    ApiKeySerializer,
    DeploymentProfileSerializer,
    ModelSerializer,
    NewApiKeySerializer,
    ProjectSerializer,
    RegisterAdapterSerializer,
    RevisionSerializer,
)


class WhoAmI(APIView):
    @extend_schema(responses=ProjectSerializer, summary="The API key's project, its credit and the upload limits")
    def get(self, request: Request) -> Response:
        project = project_of(request)
        credit = project.credit()
        return Response(
            {
                "id": project.id,
                "name": project.name,
                "key_scope": request.auth.scope,
                "blocked": project.blocked,
                "balance_usd": float(credit.balance),
                "held_usd": float(credit.held),
                "available_usd": float(credit.available),
                # So that a client can refuse an upload before sending it.
                "limits": {
                    "calibration_file_bytes": settings.CALIBRATION_MAX_BYTES,
                    "adapter_archive_bytes": settings.ADAPTER_MAX_BYTES,
                },
            }
        )


@extend_schema_view(get=extend_schema(summary="The project's API keys, newest first (never the keys themselves)"))
class ApiKeyList(ListAPIView):
    serializer_class = ApiKeySerializer

    def get_queryset(self) -> Any:
        return project_of(self.request).api_keys.order_by("-created_at", "-id")

    @extend_schema(summary="Create an API key (a key of the full scope only); the key is in this answer only",
                   request=ApiKeySerializer, responses={201: NewApiKeySerializer})
    def post(self, request: Request) -> Response:
        fields = ApiKeySerializer(data=request.data)
        fields.is_valid(raise_exception=True)
        key, raw = ApiKey.issue(project_of(request), fields.validated_data["name"], fields.validated_data["scope"])
        return Response({**ApiKeySerializer(key).data, "key": raw}, status=201)


@takes_uploads
@extend_schema_view(get=extend_schema(summary="The project's models and the public base models, newest first", parameters=[
    OpenApiParameter("kind", str, description="Only models of this kind: base, adapter, merged, full or prepared"),
]))
class ModelList(ListAPIView):
    serializer_class = ModelSerializer

    def get_queryset(self) -> Any:
        project = project_of(self.request)
        models = Model.objects.filter(Q(project=project) | Q(project__isnull=True)).select_related("supported_base")
        kind = self.request.query_params.get("kind")
        if kind:
            models = models.filter(kind=kind)
        return models.prefetch_related(NEWEST_FIRST).order_by("-created_at", "id")

    @extend_schema(
        summary="Register a LoRA adapter from an archive (or add a revision to one)",
        request={"multipart/form-data": RegisterAdapterSerializer},
        responses={201: ModelSerializer},
    )
    def post(self, request: Request) -> Response:
        project = project_of(request)
        upload = uploaded_file(request, "file", settings.ADAPTER_MAX_BYTES, "The adapter archive")
        model, _ = services.register_adapter(
            project,
            Path(upload.temporary_file_path()),  # the size-limited handler always spills to disk
            base_model=str(request.data.get("base_model", "")),
            name=str(request.data.get("name", "")),
            model_id=str(request.data.get("model_id", "")) or None,
        )
        model = Model.objects.prefetch_related(NEWEST_FIRST).select_related("supported_base").get(pk=model.pk)
        return Response(ModelSerializer(model).data, status=201)


class ModelDetail(APIView):
    @extend_schema(responses=ModelSerializer)
    def get(self, request: Request, model_id: str) -> Response:
        model = get_model(project_of(request), model_id, Model.objects.prefetch_related(NEWEST_FIRST).select_related("supported_base"))
        return Response(ModelSerializer(model).data)


class RevisionList(ListAPIView):
    serializer_class = RevisionSerializer

    def get_queryset(self) -> Any:
        model = get_model(project_of(self.request), self.kwargs["model_id"])
        return model.revisions.order_by("-number")


class RevisionDetail(APIView):
    @extend_schema(responses=RevisionSerializer)
    def get(self, request: Request, model_id: str, revision_id: str) -> Response:
        revision = get_revision(get_model(project_of(request), model_id), revision_id)
        return Response(RevisionSerializer(revision).data)


class RevisionDownload(APIView):
    @extend_schema(
        summary="The revision's files as a .tar, streamed",
        responses={(200, "application/x-tar"): OpenApiResponse(response=OpenApiTypes.BINARY)},
    )
    def get(self, request: Request, model_id: str, revision_id: str) -> StreamingHttpResponse:
        model = get_model(project_of(request), model_id)
        revision = get_revision(model, revision_id)
        return artifacts.download_response(revision)


class ModelConfigs(APIView):
    @extend_schema(
        summary="Deployment profiles the model can be served on",
        responses=inline_serializer("ConfigList", {"data": DeploymentProfileSerializer(many=True)}),
    )
    def get(self, request: Request, model_id: str) -> Response:
        model = get_model(project_of(request), model_id)
        return Response({"data": DeploymentProfileSerializer(model.deployment_profiles(), many=True).data})

