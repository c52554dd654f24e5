"""``manage.py rundemo``: the embedded default end to end, as a user would drive it.

Migrates, builds the demo (SmolLM2-135M-Instruct, a trained LoRA, a calibration file), starts the
web server and one CPU worker, then through the REST API registers the adapter, uploads the
calibration file, estimates, creates a job and follows it to the end. Then it keeps serving.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import signal
import subprocess
import sys
import tarfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from fp4prep.pipeline.validation import report
from registry.models import ApiKey, Project
from registry.services import create_project

DEMO_PROJECT = "Demo project"


class Command(BaseCommand):
    help = "Set up the embedded default, run one demo job through the API and a real worker, and serve."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-serve", action="store_true", help="stop after the job instead of serving")

    def handle(self, *args: Any, **options: Any) -> None:
        from fp4prep import demo

        call_command("migrate", verbosity=0)
        self.say("Building the demo assets (cached after the first run)...")
        assets = demo.build()
        key, project = self._project_key()
        admin_note = self._admin_user(project)
        url = f"http://127.0.0.1:{options['port']}"
        manage = [sys.executable, str(settings.BASE_DIR / "manage.py")]
        log_dir = settings.VAR_DIR / "log"
        log_dir.mkdir(parents=True, exist_ok=True)
        server = subprocess.Popen(
            [*manage, "runserver", f"127.0.0.1:{options['port']}", "--noreload"],
            stdout=(log_dir / "server.log").open("w"), stderr=subprocess.STDOUT,
        )
        worker = subprocess.Popen(
            [*manage, "runworker"], stdout=(log_dir / "worker.log").open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "FP4PREP_WORKER_KIND": "cpu"},
            start_new_session=True,  # its own process group: stopped below, with every process of the cluster
        )
        signal.signal(signal.SIGTERM, _interrupt)  # a plain kill stops the server and worker too
        try:
            self._wait_for_server(url, server)
            status = self._run_job(url, key, assets)
            if options["no_serve"]:
                if status != "completed":
                    raise CommandError(f"the demo job ended {status}; see {log_dir / 'worker.log'}")
                return
            self.say(
                f"\nServing fp4prep at {url}  (Ctrl-C stops the server and the worker)\n"
                f"  Dashboard  {url}/   {admin_note}\n"
                f"  Demo job   {url}/projects/{project.id}/\n"
                f"  API        {url}/v1/   with  Authorization: Bearer {key}\n"
                f"  API docs   {url}/v1/docs   (schema: {url}/v1/schema)\n"
                f"  Admin      {url}/admin/   (the same user)\n"
                f"  Logs       {log_dir}/server.log, worker.log"
            )
            server.wait()
        except KeyboardInterrupt:
            self.say("\nStopping.")
        finally:
            for process in (worker, server):
                process.terminate()
            # The cluster finishes a running task before it stops; a demo that is told to stop doesn't wait.
            for process in (worker, server):
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)

    def say(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def _project_key(self) -> tuple[str, Project]:
        project = Project.objects.filter(name=DEMO_PROJECT).first()
        if project is None:
            project, key = create_project(DEMO_PROJECT, Decimal(10))
            self.say(f"Created {project.id} ({DEMO_PROJECT}) with $10.00 of credit.")
            return key, project
        _, key = ApiKey.issue(project, "rundemo")
        return key, project

    def _admin_user(self, project: Project) -> str:
        """A superuser who is also a member of the demo project, so the dashboard shows its job."""
        users = get_user_model().objects
        user = users.filter(username="admin").first()
        note = "(user admin, password as printed on the first run)"
        if user is None:
            password = secrets.token_urlsafe(12)
            user = users.create_superuser("admin", password=password)
            note = f"user admin, password {password}"
        project.members.add(user)
        return note

    def _wait_for_server(self, url: str, server: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise CommandError(f"the web server exited; see {settings.VAR_DIR / 'log' / 'server.log'}")
            try:
                requests.get(f"{url}/v1/schema", timeout=2)
                return
            except requests.ConnectionError:
                time.sleep(0.3)
        raise CommandError("the web server did not start within 60 s")

    def _run_job(self, url: str, key: str, assets: Any) -> str:
        """The demo job through the API, as a script would drive it: the Python client, and the
        CLI's watch for the events."""
        from fp4prep.cli.training import watch
        from fp4prep.client import Client
        from fp4prep.demo import BASE_ID

        client = Client(api_key=key, base_url=url)
        model = client.models.register_adapter(_tar_gz(assets.adapter_dir), base_model=BASE_ID, name="demo sentiment adapter")
        assert model.latest_revision is not None
        self.say(f"Registered adapter {model.id} revision {model.latest_revision.id}")
        upload = client.files.upload(assets.calibration_file)
        self.say(f"Uploaded calibration file {upload.id}: {upload.status}, {upload.report.conversations} conversations")
        inputs = {"adapter_object_id": model.id, "calibration_file_id": upload.id}
        jobs = client.post_training.prepare_for_fp4_inference
        estimate = jobs.estimate_cost(inputs)
        self.say(
            f"The estimated price of this job is ${estimate.price_usd:.2f} and it is expected to run for about "
            f"{estimate.time_hours:.2f}h (excluding queue time)."
        )
        job = jobs.create(inputs)
        self.say(f"Created job {job.id} ({job.status})")
        watch(client, job.id, interval=1.0)
        job = jobs.retrieve(job.id)
        if job.results is not None and job.report:
            results = job.results
            self.say(f"\nPrepared model {results.api_model_object_id} revision {results.api_model_revision_id}")
            for line in report.headline(job.report):
                self.say(f"  {line}")
            self.say(
                f"  download: curl -H 'Authorization: Bearer {key}' -o model.tar "
                f"{url}/v1/models/{results.api_model_object_id}/revisions/{results.api_model_revision_id}/download"
            )
        return job.status


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _tar_gz(directory: Path) -> io.BytesIO:
    """The adapter directory as the archive a user uploads (named, so the server knows its format)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(directory, arcname="adapter")
    buffer.seek(0)
    buffer.name = "adapter.tar.gz"
    return buffer
