"""The registry app: projects, API keys, credit, models, revisions and the supported-base catalogue."""

from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "registry"
    verbose_name = "Registry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import schema  # noqa: F401 - registers the OpenAPI authentication extension
