"""Plain helpers for the page tests: screenshots, and the newest job of a project."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jobs.models import Job
from registry.models import Project

ROOT = Path(__file__).resolve().parents[3]


# The screenshots CI keeps (docs/service.md, "The dashboard"): every page, desktop and phone width.
SCREENSHOTS = Path(os.environ.get("FP4PREP_SCREENSHOTS", ROOT / "artifacts" / "screenshots"))


CHROMIUM = os.environ.get("FP4PREP_CHROMIUM", "/usr/bin/chromium")


VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}


class Shooter:
    """Saves the current page at desktop and phone width, then puts the viewport back."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, page: Any, name: str) -> None:
        for label, size in VIEWPORTS.items():
            page.set_viewport_size(size)
            page.screenshot(path=str(self.folder / f"{name}-{label}.png"), full_page=True)
        page.set_viewport_size(VIEWPORTS["desktop"])


def job_of(project: Project, status: str | None = None) -> Job:
    jobs = Job.objects.filter(project=project)
    return (jobs.filter(status=status) if status else jobs).latest("created_at")
