"""Prompts happen only for a person at a terminal: driven here through a pseudo-terminal."""

from __future__ import annotations

from typing import Any

import pexpect

from jobs.models import Job

from .helpers import Cli


def test_create_asks_to_confirm_in_a_terminal_and_creates_only_on_yes(terminal: Any, adapter: dict[str, Any]) -> None:
    child = terminal("training", "fp4", "create", adapter["id"])
    child.expect_exact("The estimated price of this job is $0.10 and it is expected to run for about 0.05h (excluding queue time).")
    child.expect_exact("Create this job for $0.10? [y/N] ")
    child.sendline("n")
    child.expect_exact("Not created.")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1 and not Job.objects.exists()

    child = terminal("training", "fp4", "create", adapter["id"])
    child.expect_exact("Create this job for $0.10? [y/N] ")
    child.sendline("y")
    child.expect(r"Created job (shp-quant-\S+) \(pending\)")
    job_id = child.match.group(1)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and list(Job.objects.values_list("id", flat=True)) == [job_id]


def test_create_does_not_ask_with_confirm_or_in_ci(terminal: Any, adapter: dict[str, Any]) -> None:
    for args, env in ((["-y"], {}), (["--confirm"], {}), ([], {"CI": "true"})):
        child = terminal("training", "fp4", "create", adapter["id"], *args, **env)
        index = child.expect([r"Created job shp-quant-\S+ \(pending\)", r"\[y/N\]"])
        assert index == 0, (args, env)
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    assert Job.objects.count() == 3


def test_cancel_asks_then_says_why_a_job_is_not_cancellable(terminal: Any, cli: Cli, people: Any, adapter: dict[str, Any]) -> None:
    job_id = people.alice.create(adapter_object_id=adapter["id"]).json()["id"]
    child = terminal("training", "fp4", "cancel", job_id)
    child.expect_exact(f"Cancel job {job_id}? [y/N] ")
    child.sendline("y")
    child.expect_exact(f"Cancellation requested for {job_id} (cancel_requested); it reaches cancelled once the run stops.")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    again = cli("training", "fp4", "cancel", job_id, "--force")
    assert again.returncode == 2 and again.stderr.startswith(f"error: Shaping job {job_id} is not cancellable: ")
    assert again.stderr.count("\n") == 1


def test_stopping_a_watch_leaves_the_job_running_and_a_second_watch_resumes(
    terminal: Any, people: Any, adapter: dict[str, Any], start_worker: Any
) -> None:
    job_id = people.alice.create(adapter_object_id=adapter["id"]).json()["id"]
    child = terminal("training", "fp4", "get", job_id, "--watch", "--interval", "0.3")
    child.expect_exact("Status: pending")
    child.sendintr()
    child.expect_exact(f"Stopped watching; the job goes on. Resume with: fp4prep training fp4 get {job_id} --watch")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 and Job.objects.get(pk=job_id).status == "pending"

    start_worker("cpu")
    child = terminal("training", "fp4", "get", job_id, "--watch", "--interval", "0.3")
    child.expect_exact("Status: completed", timeout=300)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
