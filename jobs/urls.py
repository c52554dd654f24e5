"""The jobs app's REST API under ``/v1/``: files, and the prepare-for-FP4-inference jobs."""

from django.urls import path

from . import api

PREFIX = "post-training/prepare-for-fp4-inference"

urlpatterns = [
    path("files", api.FileList.as_view(), name="api-files"),
    path("files/<str:file_id>", api.FileDetail.as_view(), name="api-file"),
    path(f"{PREFIX}/estimate", api.Estimate.as_view(), name="api-estimate"),
    path(PREFIX, api.JobList.as_view(), name="api-jobs"),
    path(f"{PREFIX}/<str:job_id>", api.JobDetail.as_view(), name="api-job"),
    path(f"{PREFIX}/<str:job_id>/events", api.JobEvents.as_view(), name="api-job-events"),
    path(f"{PREFIX}/<str:job_id>/cancel", api.JobCancel.as_view(), name="api-job-cancel"),
]
