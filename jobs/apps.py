"""The jobs app: calibration files, estimates, jobs and their events, the queue and its workers."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from registry.support import ensure_support_group

        from . import checks  # noqa: F401 - registers the system checks
        from .lifecycle import slot_freed
        from .scheduler import on_slot_freed

        # After the jobs app migrates, both apps' permissions exist.
        post_migrate.connect(ensure_support_group, sender=self, dispatch_uid="fp4prep-support-group")
        # A job that ended or was cancelled frees a slot: the scheduler dispatches the next one.
        slot_freed.connect(on_slot_freed, dispatch_uid="fp4prep-dispatch")
