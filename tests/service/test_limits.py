"""Limits that protect the service: request bodies, sign-in attempts, passwords, API request rates."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

from .helpers import People, error_of

JOBS = "/v1/post-training/prepare-for-fp4-inference"


def test_bodies_over_the_limit_are_refused_before_they_are_read_except_by_uploads(people: People, adapter: dict[str, Any]) -> None:
    big = b"x" * (2 * 1024 * 1024)
    for path in (JOBS + "/estimate", JOBS):
        # A multipart body with a file would have been spooled to disk; JSON parsed whole.
        status, code, message = error_of(people.alice.post(path, files={"file": ("f.bin", big)}))
        assert (status, code) == (413, "payload_too_large") and message.endswith("is over the limit of 1 MiB for this endpoint")
        padded = {"inputs": {"adapter_object_id": adapter["id"]}, "pad": "x" * len(big)}
        assert error_of(people.alice.post(path, json=padded))[0] == 413
    assert people.alice.get(JOBS).json()["total"] == 0
    # The upload endpoints keep their own, larger limits.
    line = (json.dumps({"messages": [{"role": "user", "content": "x" * 500}]}) + "\n").encode()
    assert people.alice.upload_file(line * 5000).status_code == 201


def test_a_page_form_over_the_limit_is_refused(people: People) -> None:
    client = Client()
    client.force_login(User.objects.get(username="alice"))
    response = client.post(f"/projects/{people.project_a.id}/prepare/estimate", {"adapter": "x" * (2 * 1024 * 1024)})
    assert response.status_code == 413


def sign_in(client: Client, password: str, path: str = "/login/") -> Any:
    return client.post(path, {"username": "alice", "password": password})


def test_repeated_failed_sign_ins_lock_that_user_out_from_that_address(people: People) -> None:
    client = Client()
    for _ in range(4):
        assert sign_in(client, "wrong").status_code == 200  # the form again, with its error
    assert sign_in(client, "wrong").status_code == 429  # the fifth failure locks
    locked = sign_in(client, "pw")
    assert locked.status_code == 429 and "Too many sign-in attempts" in locked.content.decode()
    assert "_auth_user_id" not in client.session
    # Another user, and the admin's sign-in for the same user, are judged the same way.
    assert sign_in(client, "wrong", "/admin/login/").status_code == 429
    other = Client().post("/login/", {"username": "bob", "password": "pw"})
    assert other.status_code == 302


def test_behind_a_trusted_proxy_a_lockout_is_the_clients_own(people: People) -> None:
    # One proxy in front: every request reaches the site from the proxy's address, and the client's
    # is the last X-Forwarded-For entry. An attacker's failures lock out only the attacker's address.
    def through_proxy(client_address: str, password: str, path: str = "/login/", spoofed: str = "") -> Any:
        forwarded = f"{spoofed}, {client_address}" if spoofed else client_address
        return Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=forwarded).post(path, {"username": "alice", "password": password})

    with override_settings(TRUSTED_PROXIES=1):
        for _ in range(4):
            assert through_proxy("203.0.113.9", "wrong").status_code == 200
        assert through_proxy("203.0.113.9", "wrong").status_code == 429
        assert through_proxy("203.0.113.9", "pw").status_code == 429
        # The real user, from another address, signs in on the dashboard and the admin alike.
        assert through_proxy("198.51.100.4", "pw").status_code == 302
        assert through_proxy("198.51.100.4", "pw", "/admin/login/").status_code in (200, 302)
        assert through_proxy("198.51.100.4", "wrong", "/admin/login/").status_code == 200
        # The attacker can't name another address: entries before the proxy's are the client's own words.
        assert through_proxy("203.0.113.9", "pw", spoofed="198.51.100.77").status_code == 429


def test_a_successful_sign_in_resets_the_count(people: People) -> None:
    client = Client()
    for _ in range(4):
        sign_in(client, "wrong")
    assert sign_in(client, "pw").status_code == 302
    client.logout()
    for _ in range(4):
        sign_in(client, "wrong")
    assert sign_in(client, "pw").status_code == 302


def test_weak_passwords_are_refused() -> None:
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError

    for weak in ("pw", "password123", "12345678901"):
        with pytest.raises(ValidationError):
            validate_password(weak)
    validate_password("correct horse battery staple")


def test_each_api_key_is_rate_limited_on_its_own(people: People) -> None:
    with override_settings(API_RATE="5/min"):
        for _ in range(5):
            assert people.alice.get("/v1/whoami").status_code == 200
        response = people.alice.get("/v1/whoami")
        status, code, message = error_of(response)
        assert (status, code) == (429, "throttled") and message.startswith("Request was throttled.")
        assert 0 < int(response.headers["Retry-After"]) <= 60
        assert people.bob.get("/v1/whoami").status_code == 200  # bob's key is his own


def test_all_of_a_projects_keys_share_one_rate(people: People) -> None:
    from registry.models import ApiKey

    _, extra = ApiKey.issue(people.project_a, "minted")
    with override_settings(API_RATE="100/min", API_PROJECT_RATE="6/min"):
        for person in (people.alice, people.bob, people.alice):
            assert person.get("/v1/whoami").status_code == 200
        for _ in range(3):
            assert requests_with(extra, "/v1/whoami", people).status_code == 200
        response = requests_with(extra, "/v1/whoami", people)  # a new key, but the project's 7th request
        status, code, _ = error_of(response)
        assert (status, code) == (429, "throttled") and 0 < int(response.headers["Retry-After"]) <= 60
        assert people.bob.get("/v1/whoami").status_code == 429
        assert people.charlie.get("/v1/whoami").status_code == 200  # another project's rate is its own


def requests_with(key: str, path: str, people: People) -> Any:
    import requests

    return requests.get(people.alice.base_url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_requests_without_a_valid_key_are_limited_per_address(people: People) -> None:
    import requests
    from django.core.cache import cache

    from registry.auth import AddressThrottle

    cache.delete(AddressThrottle.key_for("127.0.0.1"))
    url = people.alice.base_url
    with override_settings(API_ADDRESS_RATE="10/min"):
        answers = [requests.get(f"{url}/v1/whoami", headers={"Authorization": f"Bearer fp4_wrong{i}"}, timeout=60) for i in range(6)]
        answers += [requests.get(f"{url}/v1/whoami", timeout=60) for _ in range(2)]  # no key at all
        answers += [requests.get(f"{url}/v1/schema", timeout=60) for _ in range(2)]
        assert [a.status_code for a in answers] == [401] * 8 + [200] * 2
        # A spoofed X-Forwarded-For is not believed: no proxy is trusted by default.
        refused = requests.get(f"{url}/v1/whoami", headers={"Authorization": "Bearer fp4_wrong", "X-Forwarded-For": "10.9.8.7"}, timeout=60)
        status, code, _ = error_of(refused)
        assert (status, code) == (429, "throttled") and 0 < int(refused.headers["Retry-After"]) <= 60
        assert requests.get(f"{url}/v1/schema", timeout=60).status_code == 429
        assert people.alice.get("/v1/whoami").status_code == 200  # a valid key is not counted against its address
    cache.delete(AddressThrottle.key_for("127.0.0.1"))


def test_a_request_that_runs_out_of_memory_answers_413_and_stores_nothing(people: People, monkeypatch: Any) -> None:
    # Memory runs out where the upload's lines are validated (the fault injected): the file copied
    # so far is removed, no record is made, and the answer is the envelope, not a 500.
    from django.conf import settings

    from jobs import calibration
    from jobs.models import CalibrationFile

    def out_of_memory(lines: Any) -> Any:
        next(iter(lines))
        raise MemoryError

    folder = settings.ARTIFACT_ROOT / "files"
    stored = set(folder.rglob("*")) if folder.exists() else set()
    records = CalibrationFile.objects.count()
    monkeypatch.setattr(calibration, "validate", out_of_memory)
    line = (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n").encode()
    status, code, message = error_of(people.alice.upload_file(line * 100))
    assert (status, code) == (413, "payload_too_large")
    assert message == "The request needs more memory than the server gives one request; nothing was stored"
    client = Client()
    client.force_login(User.objects.get(username="alice"))
    from django.core.files.uploadedfile import SimpleUploadedFile

    page = client.post(f"/projects/{people.project_a.id}/files/", {"file": SimpleUploadedFile("c.jsonl", line * 100)})
    assert page.status_code == 413 and "nothing was stored" in page.content.decode()
    assert CalibrationFile.objects.count() == records and (set(folder.rglob("*")) if folder.exists() else set()) == stored


def test_with_trusted_proxies_a_request_that_bypassed_them_is_warned_about_once(people: People, caplog: Any) -> None:
    from fp4prep.site.addresses import DirectClients

    DirectClients.warned = False
    with override_settings(TRUSTED_PROXIES=1), caplog.at_level("WARNING", logger="fp4prep.site.addresses"):
        Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="203.0.113.9").get("/login/")
        assert caplog.records == []  # through the proxy
        Client(REMOTE_ADDR="198.51.100.4").get("/login/")
        Client(REMOTE_ADDR="198.51.100.5").get("/login/")
    assert [r.getMessage() for r in caplog.records] == [
        "FP4PREP_TRUSTED_PROXIES is 1, but a request from 198.51.100.4 reached the web port with no X-Forwarded-For: "
        "clients that reach it directly choose their own address (rates, sign-in lockouts). "
        "Bind the web processes where only the proxy reaches them."
    ]
