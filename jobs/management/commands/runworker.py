"""``manage.py runworker``: a django-q2 worker cluster that announces its kind and slots.

The cluster takes jobs from its kind's queue (FP4PREP_WORKER_KIND). This process sends the worker's
heartbeat and runs the dispatcher: pending jobs go to free slots, dead workers' jobs end.
``--gpu`` makes it a GPU worker whose jobs compute on CUDA; it refuses to start without a CUDA device.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.utils import timezone

from jobs import scheduler
from jobs.models import Worker

logger = logging.getLogger("jobs.worker")


class Command(BaseCommand):
    help = "Run a worker cluster of FP4PREP_WORKER_KIND with FP4PREP_WORKER_SLOTS slots."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default="", help="worker name (default: host:pid)")
        parser.add_argument(
            "--gpu",
            action="store_true",
            help="take GPU jobs and compute them on CUDA (FP4PREP_WORKER_DEVICE, default the first GPU)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["gpu"]:
            self._become_gpu_worker()
        from django_q.cluster import Cluster

        name = options["name"] or settings.WORKER_NAME or f"{socket.gethostname()}:{os.getpid()}"
        os.environ["FP4PREP_WORKER_NAME"] = name  # the cluster's processes name the jobs they run after it
        self._beat(name)
        connections.close_all()  # nothing of this process's connections crosses the fork
        cluster = Cluster()
        cluster.start()
        self.stdout.write(
            f"worker {name}: {settings.WORKER_SLOTS} {settings.WORKER_KIND.upper()} slot(s) on queue "
            f"{settings.Q_CLUSTER['cluster_name']}",
        )
        self.stdout.flush()
        try:
            while cluster.sentinel is not None and cluster.sentinel.is_alive():
                try:
                    self._beat(name)
                    scheduler.dispatch()
                except Exception:  # the database may be away for a moment; keep the cluster up
                    logger.exception("heartbeat failed")
                finally:
                    connections.close_all()
                time.sleep(settings.HEARTBEAT_INTERVAL)
        finally:
            Worker.objects.filter(name=name).delete()
            connections.close_all()

    def _become_gpu_worker(self) -> None:
        device = settings.WORKER_DEVICE if settings.WORKER_DEVICE.startswith("cuda") else "cuda"
        # Asked in a child process: CUDA must not be initialized in this one, whose cluster forks.
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, timeout=300,
        )
        count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise CommandError(
                f"runworker --gpu needs a CUDA device ({device}), and this machine has {count}: "
                "install the CUDA build of torch, or run a CPU worker without --gpu"
            )
        # Settings (and django-q2's configuration) are read from the environment at start-up: start
        # again as a GPU worker rather than patch them half-way.
        os.environ.update(FP4PREP_WORKER_KIND="gpu", FP4PREP_WORKER_DEVICE=device)
        argv = [a for a in sys.argv if a != "--gpu"]
        os.execv(sys.executable, [sys.executable, *argv])

    def _beat(self, name: str) -> None:
        now = timezone.now()
        Worker.objects.update_or_create(
            name=name,
            defaults={"kind": settings.WORKER_KIND, "slots": settings.WORKER_SLOTS, "last_seen": now},
            create_defaults={"kind": settings.WORKER_KIND, "slots": settings.WORKER_SLOTS, "last_seen": now,
                             "started_at": now},
        )
