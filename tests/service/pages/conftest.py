"""Dashboard fixtures: a project with rows to list, and a headless Chromium for the browser tests
(the people, with their signed-in page clients, are the service tests' ``people``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs import services
from jobs.models import CalibrationFile
from registry.models import Model, Revision

from .helpers import CHROMIUM, SCREENSHOTS, VIEWPORTS, Shooter


@pytest.fixture
def filled(people: Any, catalogue: Any) -> dict[str, Any]:
    """Five adapters with two revisions each, five files, five jobs with events and five API keys, in project A."""
    from registry.models import ApiKey

    project = people.project_a
    jobs, adapters, files = [], [], []
    for i in range(5):
        adapter = Model.objects.create(project=project, kind="adapter", name=f"adapter-{i}", base_model="tests/tiny-llama", supported_base=catalogue)
        for n in (1, 2):
            Revision.objects.create(model=adapter, number=n, path=f"x/{i}/{n}", size_bytes=1, sha256="0" * 64)
        files.append(CalibrationFile.objects.create(
            project=project, filename=f"f{i}.jsonl", size_bytes=1, sha256="0" * 64, status="processed",
            report={"conversations": 1, "error_count": 0, "errors": [], "summary": "ok"},
        ))
        job = services.create_job(project, {"adapter_object_id": adapter.id})
        for k in range(3):
            job.event("JOB_STAGE", f"stage {k}")
        jobs.append(job)
        adapters.append(adapter)
        if i:
            ApiKey.issue(project, f"key {i}")
    return {"jobs": jobs, "adapters": adapters, "files": files}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium driven by Playwright: never a browser Playwright downloads. Closed after
    the module, so no event loop outlives the browser tests.

    Playwright's sync API keeps an event loop in this thread; the ORM calls made between its calls
    are plain synchronous code, which Django would otherwise refuse. The switch that allows them is
    on for this module only: left on, it leaks into processes later tests start."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"browser tests need Chromium at {CHROMIUM}: apt-get install chromium (bin/test's setup does)")
    from playwright.sync_api import sync_playwright

    with pytest.MonkeyPatch.context() as patch, sync_playwright() as playwright:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    return SCREENSHOTS


@pytest.fixture
def shoot(screenshots: Path) -> Shooter:
    return Shooter(screenshots)


# Runs in every page before its own scripts (Playwright's init scripts are not subject to the page's
# Content-Security-Policy): each violation the browser reports goes to the console, tagged.
REPORT_CSP_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (e) => {
  console.error("CSP violation: " + e.violatedDirective + " blocked " + (e.blockedURI || "inline") + " (" + e.sample + ") from " + e.sourceFile + ":" + e.lineNumber + " at " + e.documentURI);
});
"""


@pytest.fixture
def csp_violations() -> list[str]:
    """What the pages opened with ``open_page`` reported violating their Content-Security-Policy."""
    return []


@pytest.fixture
def open_page(browser: Any, live_server: Any, csp_violations: list[str]) -> Iterator[Any]:
    """A signed-in tab: open_page("alice") in its own browser context (cookies of its own)."""
    contexts: list[Any] = []

    def sign_in(username: str, password: str = "pw", landing: str = "/projects/") -> Any:
        """Sign in from the sign-in page, then wait for ``landing`` (the dashboard, or a ?next= page)."""
        context = browser.new_context(viewport=VIEWPORTS["desktop"], accept_downloads=True)
        context.add_init_script(REPORT_CSP_VIOLATIONS)
        contexts.append(context)
        page = context.new_page()
        page.on("console", lambda message: csp_violations.append(message.text) if "CSP violation" in message.text else None)
        page.set_default_timeout(30_000)
        page.goto(f"{live_server.url}/login/" + ("" if landing == "/projects/" else f"?next={landing}"))
        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_server.url}{landing}**")
        return page

    yield sign_in
    for context in contexts:
        context.close()
