"""The ``fp4prep`` command run as a real process against the live server: through pipes (no
terminal) with ``cli``, and through a pseudo-terminal with ``terminal`` (pexpect)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from .helpers import Cli, env_for


@pytest.fixture
def cli(people: Any, live_server: Any, tmp_path: Path) -> Cli:
    """alice's key."""
    return Cli(live_server.url, people.alice.key, tmp_path)


@pytest.fixture
def terminal(people: Any, live_server: Any, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    spawned: list[Any] = []

    def spawn(*args: str, **env: str) -> Any:
        child = pexpect.spawn(
            sys.executable, ["-m", "fp4prep.cli", *args], env=env_for(live_server.url, people.alice.key, **env),
            cwd=str(tmp_path), encoding="utf-8", timeout=60, dimensions=(40, 200),
            # As in a person's shell: Ctrl-C interrupts, even when the suite itself was started in
            # the background of a script (which leaves SIGINT ignored for every child).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        spawned.append(child)
        return child

    yield spawn
    for child in spawned:
        child.close(force=True)
