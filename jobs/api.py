"""REST endpoints of calibration files and FP4 preparation jobs."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from fp4prep.site.errors import InvalidInput
from fp4prep.site.middleware import takes_uploads
from fp4prep.site.rest import uploaded_file
from registry.auth import project_of

from . import calibration, services
from .models import CalibrationFile, Job, get_file, get_job
from .serializers import (
    EstimateSerializer,
    EventListSerializer,
    EventSerializer,
    FileSerializer,
    FileUploadSerializer,
    JobDetailSerializer,
    JobRequestSerializer,
    JobSerializer,
)


@takes_uploads
class FileList(ListAPIView):
    serializer_class = FileSerializer

    def get_queryset(self) -> Any:
        return CalibrationFile.objects.filter(project=project_of(self.request)).order_by("-created_at", "id")

    @extend_schema(
        summary="Upload a calibration file and validate it",
        request={"multipart/form-data": FileUploadSerializer},
        responses={201: FileSerializer},
    )
    def post(self, request: Request) -> Response:
        project = project_of(request)
        upload = uploaded_file(request, "file", settings.CALIBRATION_MAX_BYTES, "The calibration file")
        purpose = str(request.data.get("purpose", ""))
        if not purpose:
            raise InvalidInput("purpose: required; use purpose=calibration")
        with upload.open("rb") as stream:
            record = calibration.store(project, stream, upload.name or "calibration.jsonl", purpose)
        return Response(FileSerializer(record).data, status=201)


class FileDetail(APIView):
    @extend_schema(responses=FileSerializer)
    def get(self, request: Request, file_id: str) -> Response:
        return Response(FileSerializer(get_file(project_of(request), file_id)).data)


def _inputs(request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict) or "inputs" not in request.data:
        raise InvalidInput('body must be {"inputs": {"adapter_object_id": ...}}')
    return request.data["inputs"]


class Estimate(APIView):
    @extend_schema(request=JobRequestSerializer, responses=EstimateSerializer, summary="Price and time; never charges")
    def post(self, request: Request) -> Response:
        return Response(services.estimate(project_of(request), _inputs(request)).to_dict())


JOBS = Job.objects.select_related("supported_base")


@extend_schema_view(get=extend_schema(summary="The project's jobs, newest first", parameters=[
    OpenApiParameter("status", str, description="Only jobs in these statuses, comma-separated (e.g. running,queued)"),
]))
class JobList(ListAPIView):
    serializer_class = JobSerializer

    def get_queryset(self) -> Any:
        jobs = JOBS.filter(project=project_of(self.request))
        status = self.request.query_params.get("status")
        if status:
            jobs = jobs.filter(status__in=status.split(","))
        return jobs.defer("report").order_by("-created_at", "-id")  # the list shows no reports

    @extend_schema(
        request=JobRequestSerializer,
        responses={201: JobSerializer},
        summary="Create a job (holds its price)",
        parameters=[
            OpenApiParameter(
                "Idempotency-Key", str, OpenApiParameter.HEADER,
                description="Any unique string per intended job (a UUID): a retried create with the same key "
                "returns the first job, with one hold, and answers with Idempotent-Replayed: true.",
            )
        ],
    )
    def post(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        job = services.create_job(project_of(request), _inputs(request), idempotency_key=key)
        # The job as it was created (``pending``), even if the scheduler queued it the moment the
        # create committed; a replay answers with the job as it is now.
        response = Response(JobSerializer(job).data, status=201)
        if job.replayed:
            response["Idempotent-Replayed"] = "true"
        return response


class JobDetail(APIView):
    @extend_schema(responses=JobDetailSerializer)
    def get(self, request: Request, job_id: str) -> Response:
        return Response(JobDetailSerializer(get_job(project_of(request), job_id, JOBS)).data)


class JobEvents(APIView):
    @extend_schema(
        responses=EventListSerializer, summary="The job's events, oldest first",
        parameters=[OpenApiParameter("after", int, description="Only events after this event ID (the newest one seen)")],
    )
    def get(self, request: Request, job_id: str) -> Response:
        job = get_job(project_of(request), job_id)
        events = job.events.order_by("id")
        after = request.query_params.get("after")
        if after:
            if not (after.isascii() and after.isdigit() and len(after) <= 18):  # "²".isdigit(); a bigint's digits
                raise InvalidInput("after: must be an event id (a whole number)")
            events = events.filter(id__gt=int(after))
        return Response({"data": EventSerializer(events, many=True).data})


class JobCancel(APIView):
    @extend_schema(request=None, responses=JobSerializer, summary="Request cancellation")
    def post(self, request: Request, job_id: str) -> Response:
        # The job as the request left it (cancel_requested); a job no worker had yet may be settled
        # as cancelled by the time this returns, which the next read shows.
        job = services.request_cancel(project_of(request), job_id)
        return Response(JobSerializer(job).data)
