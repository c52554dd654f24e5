from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/schema", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="api-schema"),
    path("v1/", include("registry.urls")),
    path("v1/", include("jobs.urls")),
]
