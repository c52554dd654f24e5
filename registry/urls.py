"""The registry's REST API under ``/v1/``: who am I, models, revisions, downloads, adapter uploads."""

from django.urls import path

from . import api

urlpatterns = [
    path("whoami", api.WhoAmI.as_view(), name="api-whoami"),
    path("keys", api.ApiKeyList.as_view(), name="api-keys"),
    path("models", api.ModelList.as_view(), name="api-models"),
    path("models/<str:model_id>", api.ModelDetail.as_view(), name="api-model"),
    path("models/<str:model_id>/revisions", api.RevisionList.as_view(), name="api-revisions"),
    path("models/<str:model_id>/revisions/<str:revision_id>", api.RevisionDetail.as_view(), name="api-revision"),
    path(
        "models/<str:model_id>/revisions/<str:revision_id>/download",
        api.RevisionDownload.as_view(),
        name="api-revision-download",
    ),
    path("models/<str:model_id>/configs", api.ModelConfigs.as_view(), name="api-model-configs"),
]
