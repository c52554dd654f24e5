"""The ``fp4prep`` command as a real process: through pipes (``Cli``), with its environment."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def env_for(base_url: str, key: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FP4PREP_API_KEY", "FP4PREP_BASE_URL")}
    env["FP4PREP_BASE_URL"] = base_url
    if key:
        env["FP4PREP_API_KEY"] = key
    env.update(extra)
    return env


@dataclass
class Cli:
    base_url: str
    key: str | None
    cwd: Path

    def __call__(self, *args: str, key: str | None = "", timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
        """Runs ``fp4prep ARGS`` with stdin and stdout not terminals; ``key=None`` runs it without a key."""
        return subprocess.run(
            [sys.executable, "-m", "fp4prep.cli", *args],
            env=env_for(self.base_url, self.key if key == "" else key, **env),
            cwd=self.cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
        )
