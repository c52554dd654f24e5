from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from registry.support import ensure_support_group

        from . import checks  # noqa: F401 - registers the system checks

        # After the jobs app migrates, both apps' permissions exist.
        post_migrate.connect(ensure_support_group, sender=self, dispatch_uid="fp4prep-support-group")
