"""The site's URLs: the dashboard's project pages, sign-in, the admin, and the REST API under ``/v1/`` with its schema and docs."""

from django.contrib import admin
from django.contrib.auth import views as auth
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from jobs import views as jobs
from registry import views as registry

# Every dashboard page but the landing one names its project; fp4prep.site.pages checks membership.
pages = [
    path("", jobs.job_list, name="jobs"),
    path("jobs/<str:job_id>/", jobs.job_detail, name="job"),
    path("jobs/<str:job_id>/live", jobs.job_live, name="job-live"),
    path("jobs/<str:job_id>/cancel", jobs.job_cancel, name="job-cancel"),
    path("prepare/", jobs.prepare, name="prepare"),
    path("prepare/estimate", jobs.prepare_estimate, name="prepare-estimate"),
    path("prepare/create", jobs.prepare_create, name="prepare-create"),
    path("files/", jobs.files, name="files"),
    path("files/<str:file_id>/", jobs.file_detail, name="file"),
    path("adapters/", registry.adapters, name="adapters"),
    path("models/<str:model_id>/", registry.model_detail, name="model"),
    path("models/<str:model_id>/revisions/<str:revision_id>/", registry.revision_detail, name="revision"),
    path("models/<str:model_id>/revisions/<str:revision_id>/download", registry.revision_download, name="revision-download"),
    path("keys/", registry.keys, name="keys"),
    path("keys/<int:key_id>/revoke", registry.revoke_key, name="revoke-key"),
]

urlpatterns = [
    path("", registry.home, name="home"),
    path("login/", auth.LoginView.as_view(template_name="login.html", redirect_authenticated_user=True), name="login"),
    path("logout/", auth.LogoutView.as_view(), name="logout"),
    path("projects/<str:project_id>/", include(pages)),
    path("admin/", admin.site.urls),
    path("v1/schema", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="api-schema"),
    path("v1/docs", SpectacularSwaggerSplitView.as_view(url_name="api-schema", authentication_classes=[], permission_classes=[]),
         name="api-docs"),
    path("v1/", include("registry.urls")),
    path("v1/", include("jobs.urls")),
]

# Under /v1/, errors Django raises itself answer in the API's error envelope.
handler400 = "fp4prep.site.rest.bad_request"
handler403 = "fp4prep.site.rest.permission_denied"
handler404 = "fp4prep.site.rest.page_not_found"
handler500 = "fp4prep.site.rest.server_error"
