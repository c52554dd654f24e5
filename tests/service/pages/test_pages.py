"""The dashboard's views through Django's test client: the project boundary on every URL, query
counts of the list pages and the polled job partial, and the forms' errors. The browser tests
(test_browser.py) drive the same pages in Chromium."""

from __future__ import annotations

from typing import Any

import pytest

from jobs import services
from jobs.models import Job
from registry.models import ApiKey, Model, Revision

from ..helpers import People


def urls_of(project_id: str, data: dict[str, Any]) -> list[str]:
    job, adapter, file = data["jobs"][0], data["adapters"][0], data["files"][0]
    revision = adapter.revisions.first()
    base = f"/projects/{project_id}"
    return [
        f"{base}/",
        f"{base}/jobs/{job.id}/",
        f"{base}/jobs/{job.id}/live",
        f"{base}/prepare/",
        f"{base}/files/",
        f"{base}/files/{file.id}/",
        f"{base}/adapters/",
        f"{base}/models/{adapter.id}/",
        f"{base}/models/{adapter.id}/revisions/{revision.id}/",
        f"{base}/keys/",
    ]


def test_every_page_renders_for_a_member(people: People, filled: dict[str, Any]) -> None:
    for url in urls_of(people.project_a.id, filled):
        for client in (people.alice.web, people.bob.web):
            response = client.get(url)
            assert response.status_code == 200, url


def test_an_outsider_gets_404_on_every_page_of_another_project(people: People, filled: dict[str, Any]) -> None:
    a, c = people.project_a.id, people.project_c.id
    for url in urls_of(a, filled):
        assert people.charlie.web.get(url).status_code == 404, url
        # ...and with his own project in the URL, alice's objects don't exist there either
        if url != f"/projects/{a}/" and not url.endswith(("/prepare/", "/files/", "/adapters/", "/keys/")):
            assert people.charlie.web.get(url.replace(a, c)).status_code == 404, url
    job = filled["jobs"][0]
    assert people.charlie.web.post(f"/projects/{a}/jobs/{job.id}/cancel").status_code == 404
    assert people.charlie.web.post(f"/projects/{c}/jobs/{job.id}/cancel").status_code == 404
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


def test_signed_out_visitors_are_sent_to_sign_in(people: People, filled: dict[str, Any]) -> None:
    from django.test import Client

    response = Client().get(f"/projects/{people.project_a.id}/jobs/{filled['jobs'][0].id}/")
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_the_landing_page_opens_the_last_project_looked_at(people: People) -> None:
    from registry.services import create_project

    second, _ = create_project("Alice's second project", user=people.alice.user)
    assert people.alice.web.get("/")["Location"] == f"/projects/{people.project_a.id}/"  # alphabetically first
    people.alice.web.get(f"/projects/{second.id}/")
    assert people.alice.web.get("/")["Location"] == f"/projects/{second.id}/"
    page = people.alice.web.get(f"/projects/{second.id}/").content.decode()
    assert "Alice&#x27;s project" in page and "Alice&#x27;s second project" in page  # the switcher


def test_a_user_in_no_project_sees_why(people: People) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client()
    client.force_login(get_user_model().objects.create_user("dave", password="pw"))
    response = client.get("/")
    assert response.status_code == 200 and "not a member of any project" in response.content.decode()


@pytest.mark.parametrize(
    ("page", "queries"),
    [
        # session, user, project membership, then: count, rows, credit, switcher
        ("", 7),
        ("?status=active", 7),
        ("files/", 7),
        ("adapters/", 10),  # + revisions prefetch, prepared models, catalogue (base hints)
        ("keys/", 7),
    ],
)
def test_list_pages_take_a_fixed_number_of_queries(
    people: People, filled: dict[str, Any], django_assert_num_queries: Any, page: str, queries: int
) -> None:
    people.alice.web.get(f"/projects/{people.project_a.id}/")  # the session records the project once
    with django_assert_num_queries(queries):
        response = people.alice.web.get(f"/projects/{people.project_a.id}/{page}")
    assert response.status_code == 200
    assert response.content.decode().count("<tr>") >= 5


def test_long_lists_are_paged_and_keep_their_filter(people: People, filled: dict[str, Any]) -> None:
    adapter = filled["adapters"][0]
    for _ in range(21):  # 26 pending jobs with the five of `filled`
        services.create_job(people.project_a, {"adapter_object_id": adapter.id})
    base = f"/projects/{people.project_a.id}/"
    first = people.alice.web.get(f"{base}?status=active").content.decode()
    assert first.count("<tr>") == 26 and 'href="?status=active&amp;page=2">Older →</a>' in first and "Page 1 of 2" in first
    second = people.alice.web.get(f"{base}?status=active&page=2").content.decode()
    assert second.count("<tr>") == 2 and 'href="?status=active&amp;page=1">← Newer</a>' in second
    assert "Page 1 of 1" not in people.alice.web.get(f"{base}?status=completed").content.decode()


def test_the_polled_job_partial_takes_a_fixed_number_of_queries_and_stops_when_the_job_ends(
    people: People, filled: dict[str, Any], django_assert_num_queries: Any
) -> None:
    job = filled["jobs"][0]
    url = f"/projects/{people.project_a.id}/jobs/{job.id}/live"
    people.alice.web.get(f"/projects/{people.project_a.id}/")
    with django_assert_num_queries(5):  # session, user, membership, the job in the project with its relations, events
        response = people.alice.web.get(url, headers={"HX-Request": "true"})
    html = response.content.decode()
    assert response.status_code == 200 and 'hx-trigger="every 2s"' in html and "<html" not in html
    assert html.count("<li><time") == 4  # the creation event and three stage events

    services.request_cancel(people.project_a, job.id)  # a pending job: settled as cancelled at once
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED
    response = people.alice.web.get(url, headers={"HX-Request": "true"})
    html = response.content.decode()
    assert response.status_code == 286  # htmx stops polling
    assert 'data-status="cancelled"' in html and "hx-trigger" not in html


def test_cancel_from_the_page_and_a_second_cancel_says_why_not(people: People, filled: dict[str, Any]) -> None:
    job = filled["jobs"][1]
    url = f"/projects/{people.project_a.id}/jobs/{job.id}/cancel"
    response = people.bob.web.post(url, headers={"HX-Request": "true"})
    html = response.content.decode()
    # the step the request took, still polling; no worker had the job, so the next poll shows its end
    assert response.status_code == 200 and 'data-status="cancel_requested"' in html and 'hx-trigger="every 2s"' in html
    assert "Cancel job" not in html
    response = people.bob.web.get(f"/projects/{people.project_a.id}/jobs/{job.id}/live", headers={"HX-Request": "true"})
    assert response.status_code == 286 and 'data-status="cancelled"' in response.content.decode()
    response = people.bob.web.post(url)  # without JavaScript: the whole page, with the reason
    assert response.status_code == 409
    assert f"Shaping job {job.id} is not cancellable: it has already ended (cancelled)" in response.content.decode()


def test_estimate_shows_price_and_credit_and_create_needs_the_confirmed_price(people: People, filled: dict[str, Any]) -> None:
    adapter = filled["adapters"][0]
    base = f"/projects/{people.project_a.id}/prepare"
    form = {"adapter": adapter.id, "revision": "", "calibration_file": filled["files"][0].id}
    html = people.alice.web.post(f"{base}/estimate", form, headers={"HX-Request": "true"}).content.decode()
    assert 'data-price="0.10"' in html and "Allowed to proceed" in html and "$9.50 available" in html  # 5 jobs hold $0.50
    assert 'name="confirm_price" value="0.10"' in html

    before = Job.objects.count()
    response = people.alice.web.post(f"{base}/create", {**form, "confirm_price": "0.01"}, headers={"HX-Request": "true"})
    assert response.status_code == 409 and "Confirm the price first: the job costs $0.10." in response.content.decode()
    assert Job.objects.count() == before

    response = people.alice.web.post(f"{base}/create", {**form, "confirm_price": "0.10"}, headers={"HX-Request": "true"})
    job = Job.objects.latest("created_at")
    assert response.status_code == 200 and response["HX-Redirect"] == f"/projects/{people.project_a.id}/jobs/{job.id}/"
    assert job.adapter_id == adapter.id and job.calibration_file_id == filled["files"][0].id
    assert job.adapter_revision_id == adapter.latest_revision().id


def test_estimate_errors_are_the_services_messages(people: People, filled: dict[str, Any]) -> None:
    base = f"/projects/{people.project_a.id}/prepare"
    other = Model.objects.create(project=people.project_c, kind="adapter", name="x", base_model="tests/tiny-llama")
    response = people.alice.web.post(f"{base}/estimate", {"adapter": other.id}, headers={"HX-Request": "true"})
    assert response.status_code == 404 and f"model {other.id} does not exist in this project" in response.content.decode()

    people.project_a.block("unpaid invoice")
    html = people.alice.web.post(f"{base}/estimate", {"adapter": filled["adapters"][0].id}).content.decode()
    assert "Not allowed to proceed." in html and "is blocked from starting jobs (unpaid invoice)" in html
    assert "Create job" not in html


def test_choosing_an_adapter_refreshes_its_revisions(people: People, filled: dict[str, Any]) -> None:
    adapter = filled["adapters"][2]
    response = people.alice.web.get(
        f"/projects/{people.project_a.id}/prepare/?adapter={adapter.id}", headers={"HX-Request": "true", "HX-Target": "revision-field"}
    )
    html = response.content.decode()
    assert html.lstrip().startswith('<div class="field" id="revision-field">')
    for revision in adapter.revisions.all():
        assert revision.id in html


def test_a_calibration_upload_from_the_prepare_page_reports_its_errors_inline(people: People, calibration_bytes: bytes) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    url = f"/projects/{people.project_a.id}/files/"
    hx = {"HX-Request": "true", "HX-Target": "calibration-field"}
    bad = b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n{"messages": []}\n'
    response = people.alice.web.post(url, {"file": SimpleUploadedFile("bad.jsonl", bad)}, headers=hx)
    html = response.content.decode()
    assert response.status_code == 200 and "did not pass validation" in html
    assert '<span class="line">line 2</span>' in html and '<span class="line">line 3</span>' in html

    response = people.alice.web.post(url, {"file": SimpleUploadedFile("good.jsonl", calibration_bytes)}, headers=hx)
    html = response.content.decode()
    assert "passed validation: 120 conversations" in html
    good = people.project_a.files.get(filename="good.jsonl")
    assert f'<option value="{good.id}" selected>' in html


def test_an_upload_over_the_limit_stores_nothing_and_says_so(people: People, settings: Any) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.CALIBRATION_MAX_BYTES = 1000
    response = people.alice.web.post(f"/projects/{people.project_a.id}/files/", {"file": SimpleUploadedFile("big.jsonl", b"x" * 5000)})
    assert response.status_code == 400
    assert "The calibration file is larger than the limit of 1,000 bytes; nothing was stored" in response.content.decode()
    assert not people.project_a.files.exists()


def test_registering_a_bad_adapter_archive_shows_why(people: People, catalogue: Any) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = people.alice.web.post(
        f"/projects/{people.project_a.id}/adapters/",
        {"name": "x", "base_model": "tests/tiny-llama", "file": SimpleUploadedFile("a.tar.gz", b"not an archive")},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 400 and 'role="alert"' in response.content.decode()
    assert not Model.objects.filter(project=people.project_a).exists()


def test_api_keys_are_shown_once_and_revoked_only_in_their_project(people: People) -> None:
    url = f"/projects/{people.project_a.id}/keys/"
    html = people.alice.web.post(url, {"name": "CI pipeline"}).content.decode()
    key = ApiKey.objects.get(name="CI pipeline")
    raw = html.split("<code data-key>")[1].split("</code>")[0]
    assert ApiKey.find(raw) == key
    assert raw not in people.alice.web.get(url).content.decode()  # only once

    assert people.charlie.web.post(f"/projects/{people.project_c.id}/keys/{key.id}/revoke").status_code == 404
    assert people.alice.web.post(f"/projects/{people.project_a.id}/keys/{key.id}/revoke").status_code == 302
    assert ApiKey.find(raw) is None


def test_the_revision_page_gives_the_exact_vllm_command(people: People, catalogue: Any) -> None:
    from registry.models import DeploymentProfile

    DeploymentProfile.objects.create(supported_base=catalogue, name="Two H200", hardware="H200", gpu_count=2, quantization="nvfp4")
    model = Model.objects.create(project=people.project_a, kind="prepared", name="bot (NVFP4)", base_model="tests/tiny-llama-nvfp4", supported_base=catalogue)
    revision = Revision.objects.create(model=model, number=1, path="p", size_bytes=1, sha256="0" * 64, metadata={"quantization": "nvfp4"})
    html = people.alice.web.get(f"/projects/{people.project_a.id}/models/{model.id}/revisions/{revision.id}/").content.decode()
    directory = f"{model.id}-{revision.id}"
    serve = f"vllm serve ./{directory} \\\n    --quantization modelopt_fp4 \\\n    --tensor-parallel-size 2 \\\n    --served-model-name &#x27;bot (NVFP4)&#x27;"
    assert serve in html
    assert f"http://testserver/v1/models/{model.id}/revisions/{revision.id}/download \\\n    -o {directory}.tar" in html
    assert f"mkdir -p {directory} &amp;&amp; tar -xf {directory}.tar -C {directory}" in html
    assert "W4A4" not in html  # NVFP4 runs on every profile as its parity measured it


def test_an_mxfp4_revision_on_blackwell_shows_what_vllm_computes_there(people: People, catalogue: Any) -> None:
    """vLLM 0.33 runs MXFP4 W4A4 on Blackwell: the page gives the job's figures measured that way,
    and where they miss the bar, the setting that makes vLLM run the linear layers weights-only."""
    from fp4prep.pipeline.serving import MXFP4_W4A4
    from registry.models import DeploymentProfile

    for name, hardware in (("Hopper", "NVIDIA H200"), ("Blackwell", "NVIDIA B200")):
        DeploymentProfile.objects.create(supported_base=catalogue, name=name, hardware=hardware, gpu_count=8, quantization="mxfp4")
    model = Model.objects.create(project=people.project_a, kind="prepared", name="bot (MXFP4)", base_model="tests/tiny-llama-mxfp4", supported_base=catalogue)
    parity = {"answer_top1": 0.801, "answer_kl": 0.972, "continuation_top1": 0.77}
    served = {"numerics": "mxfp4-w4a4", "description": "vLLM 0.33 on Blackwell quantizes inputs too (W4A4)", "hardware": ["NVIDIA B200"],
              "parity": parity, "task": None, "misses": ["mean KL on the assistant turns 0.972 > 0.5"],
              "as_declared_flag": MXFP4_W4A4.as_declared_flag}
    pages = {}
    for number, metadata in enumerate(({"quantization": "mxfp4"}, {"quantization": "mxfp4", "report": {"serving": [served]}}), 1):
        revision = Revision.objects.create(model=model, number=number, path="p", size_bytes=1, sha256="0" * 64, metadata=metadata)
        html = people.alice.web.get(f"/projects/{people.project_a.id}/models/{model.id}/revisions/{revision.id}/").content.decode()
        pages[number] = {part.split(" ", 1)[0]: part for part in html.split('<div class="panel" id="serve">')[1].split("<h3>")[1:]}
    for sections in pages.values():
        assert "--quantization compressed-tensors" in sections["Hopper"] and "W4A4" not in sections["Hopper"]
    # A revision whose job did not measure it says what vLLM does there, and that it was not measured.
    assert "job did not measure it that way" in pages[1]["Blackwell"] and "--kernel-config" not in pages[1]["Blackwell"]
    blackwell = pages[2]["Blackwell"]
    assert "On NVIDIA B200: vLLM 0.33 on Blackwell quantizes inputs too (W4A4): on answers top-1 0.801, KL 0.9720" in blackwell
    assert "misses the thresholds (mean KL on the assistant turns 0.972 &gt; 0.5)" in blackwell
    flag = "--kernel-config &#x27;{&quot;linear_backend_per_quant&quot;: {&quot;mxfp4&quot;: &quot;marlin&quot;}}&#x27;"
    assert f"--served-model-name &#x27;bot (MXFP4)&#x27; \\\n    {flag}</code>" in blackwell
    assert "routed experts of a mixture-of-experts model stay W4A4" in blackwell
