"""The dashboard in headless Chromium against a live server and a real worker process.

alice signs in, registers an adapter, uploads a bad calibration file and reads its errors, uploads a
good one, estimates, creates a job after confirming and watches it complete without reloading, then
reads the quality chart and downloads the checkpoint. bob, her teammate, starts a job and cancels it
while it runs. charlie, an outsider, gets 404 on both jobs. Every page is saved as a screenshot at
desktop and phone width (docs/service.md, "The dashboard").
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path
from typing import Any

from jobs.models import Job
from registry.models import Revision
from tests.service.helpers import TINY_BASE_ID

from .helpers import Shooter, job_of

RUN_TIMEOUT = 300_000  # ms: a tiny job on a loaded 2-core machine


def register_adapter(page: Any, shoot: Shooter, base: str, archive: bytes) -> None:
    page.goto(f"{base}/adapters/")
    shoot(page, "models-empty")
    page.fill("#id_name", "support-bot")
    page.fill("#id_base_model", TINY_BASE_ID)
    page.set_input_files("#id_archive", {"name": "support-bot.tar.gz", "mimeType": "application/gzip", "buffer": archive})
    page.click("#register button[type=submit]")
    page.wait_for_url(f"{base}/models/**")
    assert page.locator("h1").inner_text() == "support-bot"


def calibrate_estimate_and_create(page: Any, shoot: Shooter, good: bytes | None) -> None:
    """On the prepare page: optionally the calibration uploads, then estimate and a confirmed create."""
    if good is not None:
        bad = b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n{"messages": [{"role": "robot", "content": "x"}]}\n'
        page.set_input_files("#id_file", {"name": "bad.jsonl", "mimeType": "application/jsonl", "buffer": bad})
        report = page.locator("#calibration-field .report")
        report.wait_for()
        assert "did not pass validation: 2 errors" in page.locator("#calibration-field").inner_text()
        assert report.locator("li").nth(0).inner_text().startswith("line 2")
        assert report.locator("li").nth(1).inner_text().startswith("line 3")
        shoot(page, "prepare-calibration-errors")
        page.set_input_files("#id_file", {"name": "support-chats.jsonl", "mimeType": "application/jsonl", "buffer": good})
        page.get_by_text("passed validation: 120 conversations").wait_for()
        assert "support-chats.jsonl" in page.locator("#id_calibration_file option:checked").inner_text()
    page.click("#prepare-form button[type=submit]")
    page.locator("#estimate [data-price]").wait_for()
    assert page.locator("#estimate [data-price]").inner_text() == "$0.10"
    assert "Allowed to proceed" in page.locator("#estimate").inner_text()
    shoot(page, "prepare-estimate")
    dialogs: list[str] = []
    page.once("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
    page.get_by_role("button", name="Create job for $0.10").click()
    page.wait_for_url("**/jobs/*/")
    assert dialogs == ["Create this job? $0.10 of credit will be held until it ends."]


def test_a_team_prepares_watches_downloads_and_cancels_and_an_outsider_sees_nothing(
    open_page: Any, csp_violations: list[str], live_server: Any, people: Any, catalogue: Any, start_worker: Any, shoot: Shooter,
    browser: Any, tiny_adapter_archive: bytes, calibration_bytes: bytes, tmp_path: Path,
) -> None:
    start_worker("cpu")
    project = people.project_a
    base = f"{live_server.url}/projects/{project.id}"

    login = browser.new_page(viewport={"width": 1280, "height": 800})
    login.goto(f"{live_server.url}/login/")
    shoot(login, "sign-in")
    login.close()

    # --- alice: register, calibrate, estimate, create, watch, read, download --------------------
    alice = open_page("alice")
    assert alice.url == f"{base}/"
    shoot(alice, "jobs-empty")
    register_adapter(alice, shoot, base, tiny_adapter_archive)
    alice.get_by_role("link", name="Prepare for NVFP4").click()
    alice.wait_for_url(f"{base}/prepare/**")
    calibrate_estimate_and_create(alice, shoot, calibration_bytes)
    job = job_of(project)
    assert alice.url == f"{base}/jobs/{job.id}/" and job.calibration_file is not None

    alice.evaluate("window.__samePage = true")  # gone if the page ever reloads
    polls: list[str] = []
    alice.on("request", lambda request: polls.append(request.url) if request.url.endswith("/live") else None)
    alice.locator('[data-status="running"]').wait_for(timeout=RUN_TIMEOUT)
    alice.locator(".progress").wait_for()
    shoot(alice, "job-running")
    alice.locator('[data-status="completed"]').wait_for(timeout=RUN_TIMEOUT)
    assert alice.evaluate("window.__samePage") is True
    assert len(polls) >= 1
    events = alice.locator(".events").inner_text()
    for stage in ("merging", "calibrating", "quantizing", "exporting", "validating"):
        assert stage in events.lower()
    quality = alice.locator("#quality")
    assert "Top-1 agreement on BF16's own answers" in quality.inner_text() and "Checkpoint size" in quality.inner_text()
    assert quality.locator(".fill.fp4").count() >= 3
    shoot(alice, "job-completed")
    seen = len(polls)
    alice.wait_for_timeout(4500)  # two polling periods
    assert len(polls) == seen, "polling goes on after the job ended"

    job.refresh_from_db()
    revision = Revision.objects.get(pk=job.result_revision_id)
    with alice.expect_download() as download_info:
        alice.get_by_role("link", name="Download checkpoint (.tar)").click()
    tar_path = tmp_path / "checkpoint.tar"
    download_info.value.save_as(tar_path)
    with tarfile.open(tar_path) as tar:
        got = {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert got == {f["path"]: f["sha256"] for f in revision.files}
    assert "config.json" in got

    alice.get_by_role("link", name="Serve with vLLM").click()
    alice.wait_for_url(f"{base}/models/{job.result_model_id}/revisions/{revision.id}/")
    serve = alice.locator("#serve").inner_text()
    assert f"./{job.result_model_id}-{revision.id}" in serve and "--quantization modelopt_fp4" in serve
    shoot(alice, "revision")
    alice.goto(f"{base}/models/{job.result_model_id}/")
    shoot(alice, "model-prepared")
    alice.goto(f"{base}/models/{job.adapter_id}/")
    shoot(alice, "model-adapter")
    alice.goto(f"{base}/adapters/")
    shoot(alice, "models")
    alice.goto(f"{base}/files/")
    shoot(alice, "files")
    alice.get_by_role("link", name="bad.jsonl").click()
    assert "line 2" in alice.locator(".report").inner_text()
    shoot(alice, "file-errors")
    alice.goto(f"{base}/keys/")
    alice.fill("input[name=name]", "Grafana")
    alice.select_option("select[name=scope]", "read")
    alice.get_by_role("button", name="Create key").click()
    alice.locator("[data-key]").wait_for()
    assert alice.locator("tr", has_text="Grafana").locator(".badge-read").inner_text() == "Read"
    assert project.api_keys.get(name="Grafana").scope == "read"
    alice.fill("input[name=name]", "CI pipeline")
    alice.get_by_role("button", name="Create key").click()
    alice.locator("[data-key]").wait_for()
    assert alice.locator("tr", has_text="CI pipeline").locator(".badge-full").inner_text() == "Full"
    shoot(alice, "keys")
    # Revoking asks first (a data-confirm form: the policy allows no inline handler); declined, nothing changes.
    questions: list[str] = []
    alice.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.dismiss()))
    alice.locator("tr", has_text="CI pipeline").get_by_role("button", name="Revoke").click()
    assert questions and questions[0].startswith("Revoke ") and questions[0].endswith("Anything using it stops working at once.")
    assert project.api_keys.get(name="CI pipeline").revoked_at is None
    alice.once("dialog", lambda dialog: dialog.accept())
    alice.locator("tr", has_text="CI pipeline").get_by_role("button", name="Revoke").click()
    alice.locator("tr", has_text="CI pipeline").get_by_text("Revoked").wait_for()

    # --- bob: a job without calibration data, cancelled while it runs ----------------------------
    bob = open_page("bob")
    bob.goto(f"{base}/prepare/")
    calibrate_estimate_and_create(bob, shoot, None)
    bobs_job = job_of(project, None)
    assert bobs_job.id != job.id and bob.url == f"{base}/jobs/{bobs_job.id}/"
    bob.locator('[data-status="running"]').wait_for(timeout=RUN_TIMEOUT)
    bob.once("dialog", lambda dialog: dialog.accept())
    bob.get_by_role("button", name="Cancel job").click()  # at once: a tiny job runs for seconds only
    bob.locator('[data-status="cancel_requested"]').wait_for()
    assert bob.get_by_role("button", name="Cancel job").count() == 0
    shoot(bob, "job-cancel-requested")
    bob.locator('[data-status="cancelled"]').wait_for(timeout=RUN_TIMEOUT)
    assert "Cancellation requested" in bob.locator(".events").inner_text()
    shoot(bob, "job-cancelled")
    bobs_job.refresh_from_db()
    assert bobs_job.status == Job.Status.CANCELLED and bobs_job.result_revision_id is None
    bob.goto(f"{base}/")
    assert bob.locator("tbody tr").count() == 2
    shoot(bob, "jobs")
    bob.goto(f"{base}/?status=completed")
    assert bob.locator("tbody tr").count() == 1

    # --- charlie: neither job exists for him, under either project's URL --------------------------
    charlie = open_page("charlie")
    for job_id in (job.id, bobs_job.id):
        for project_id in (project.id, people.project_c.id):
            response = charlie.goto(f"{live_server.url}/projects/{project_id}/jobs/{job_id}/")
            assert response.status == 404
            assert "Not found" in charlie.locator("h1, strong").first.inner_text()
    shoot(charlie, "not-found")

    # Every page above ran under the policy: the app's own scripts and styles only, and none refused.
    assert response.headers["content-security-policy"].startswith("default-src 'self'; script-src 'self'; style-src 'self'")
    assert csp_violations == []


def test_the_footer_links_api_docs_that_render_from_this_server_alone(
    open_page: Any, csp_violations: list[str], live_server: Any, people: Any, shoot: Shooter
) -> None:
    alice = open_page("alice")
    elsewhere: list[str] = []
    alice.on("request", lambda request: None if request.url.startswith(live_server.url) else elsewhere.append(request.url))
    alice.get_by_role("link", name="API docs").click()
    alice.wait_for_url(f"{live_server.url}/v1/docs")
    alice.locator(".opblock-summary-path").first.wait_for()  # Swagger UI ran and read the schema
    paths = alice.locator(".opblock-summary-path").all_inner_texts()
    assert "/v1/post-training/prepare-for-fp4-inference" in [p.replace("\u200b", "") for p in paths]
    assert elsewhere == [], "the docs page loaded something from outside this server"
    shoot(alice, "api-docs")
    schema = alice.request.get(f"{live_server.url}/v1/schema")
    assert schema.ok and b"openapi:" in schema.body()
    # The docs page runs under the site's policy too (its set-up script a file of its own), none refused.
    docs = alice.request.get(f"{live_server.url}/v1/docs")
    assert docs.headers["content-security-policy"].startswith("default-src 'self'; script-src 'self'; style-src 'self'")
    assert csp_violations == []


def test_the_admin_runs_under_the_same_policy(
    open_page: Any, csp_violations: list[str], live_server: Any, people: Any, catalogue: Any
) -> None:
    from django.contrib.auth.models import User

    from jobs import services

    User.objects.create_superuser("root", password="pw")
    adapter = people.project_a.models.create(kind="adapter", name="bot", base_model=TINY_BASE_ID, supported_base=catalogue)
    Revision.objects.create(model=adapter, number=1, path="x", size_bytes=1, sha256="0" * 64)
    job = services.create_job(people.project_a, {"adapter_object_id": adapter.id})
    root = open_page("root", landing="/admin/")
    for path in ("/admin/", "/admin/jobs/job/", f"/admin/jobs/job/{job.id}/change/", f"/admin/registry/project/{people.project_a.id}/change/",
                 "/admin/registry/credittransaction/add/"):
        response = root.goto(live_server.url + path)
        assert response.status == 200 and "default-src 'self'" in response.headers["content-security-policy"]
    root.goto(live_server.url + "/admin/jobs/job/")
    root.locator("select[name=action]").select_option("requeue")  # the actions bar's script runs
    assert csp_violations == []
