"""Registering adapters from archives, revisions, downloads and deployment profiles over HTTP."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from registry.artifacts import manifest
from registry.models import Model, Revision

from ..helpers import TINY_BASE_ID, People, error_of, lora_weights


def tar_gz(files: dict[str, bytes], links: dict[str, str] | None = None, directories: int = 0) -> bytes:
    """A .tar.gz of ``files``, then symbolic ``links`` (name -> target) and ``directories`` empty
    directories (d0, d1, ...)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for i in range(directories):
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buffer.getvalue()


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return buffer.getvalue()


LORA_CONFIG = b'{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}'
VALID = {"adapter_config.json": LORA_CONFIG, "adapter_model.safetensors": lora_weights()}


def test_an_adapter_registers_from_a_tar_gz_and_its_files_are_stored(people: People, catalogue: Any, tiny_adapter_archive: bytes) -> None:
    response = people.alice.register_adapter(tiny_adapter_archive, name="support-bot")
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["id"].startswith("ml_") and body["kind"] == "adapter" and body["base_model"] == TINY_BASE_ID
    assert body["supported_base"] == "Tiny-Llama" and body["project_id"] == people.project_a.id
    revision = Revision.objects.get(pk=body["latest_revision"]["id"])
    names = {f["path"] for f in revision.files}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names  # unwrapped from my-adapter/
    assert manifest(revision.directory)[2] == revision.sha256 == body["latest_revision"]["sha256"]


@pytest.mark.parametrize("inside", [".fp4prep-unwrap", ".fp4prep-unwrap/x", "wrap"])
def test_a_wrapper_folder_holding_any_name_unwraps(people: People, catalogue: Any, inside: str) -> None:
    files = {f"wrap/{name}": content for name, content in VALID.items()} | {f"wrap/{inside}": b"notes"}
    response = people.alice.post("/v1/models", files={"file": ("a.zip", zipped(files))}, data={"base_model": TINY_BASE_ID})
    assert response.status_code == 201, response.text
    revision = Revision.objects.get(pk=response.json()["latest_revision"]["id"])
    assert {f["path"] for f in revision.files} == {"adapter_config.json", "adapter_model.safetensors", inside}


def test_a_zip_registers_and_a_new_revision_goes_to_the_same_adapter(people: People, catalogue: Any) -> None:
    first = people.alice.post("/v1/models", files={"file": ("a.zip", zipped(VALID))}, data={"base_model": TINY_BASE_ID}).json()
    second = people.alice.post(
        "/v1/models", files={"file": ("a.zip", zipped({**VALID, "README.md": b"v2"}))},
        data={"base_model": TINY_BASE_ID, "model_id": first["id"]},
    )
    assert second.status_code == 201, second.text
    revisions = people.alice.get(f"/v1/models/{first['id']}/revisions").json()
    assert [r["number"] for r in revisions["data"]] == [2, 1]
    assert revisions["data"][0]["id"] == second.json()["latest_revision"]["id"]


@pytest.mark.parametrize(
    ("archive", "message"),
    [
        (tar_gz({"../escape/adapter_config.json": LORA_CONFIG}), "unsafe path"),
        (tar_gz({"/etc/adapter_config.json": LORA_CONFIG}), "unsafe path"),
        (tar_gz(VALID, links={"adapter_model.bin": "/etc/passwd"}), "is a link"),
        (zipped({"../../x": b"x", **VALID}), "unsafe path"),
        (tar_gz({"adapter_model.safetensors": lora_weights()}), "no adapter_config.json"),
        (tar_gz({"adapter_config.json": LORA_CONFIG}), "no adapter_model.safetensors or adapter_model.bin"),
        (tar_gz({"adapter_config.json": b'{"peft_type": "IA3"}', "adapter_model.safetensors": lora_weights()}), "does not describe a LoRA adapter"),
        (tar_gz({"adapter_config.json": b"{oops", "adapter_model.safetensors": lora_weights()}), "is not valid JSON"),
        (b"this is not an archive", "not a .tar.gz, .tar or .zip archive"),
        (tar_gz(VALID)[:120], "is truncated or corrupt"),
    ],
)
def test_a_malformed_archive_is_refused_and_nothing_is_registered(people: People, catalogue: Any, archive: bytes, message: str) -> None:
    from django.conf import settings

    status, code, text = error_of(people.alice.register_adapter(archive))
    assert (status, code) == (400, "invalid_archive") and message in text, text
    assert not Model.objects.filter(kind="adapter").exists()
    incoming = settings.ARTIFACT_ROOT / "incoming"
    assert not incoming.exists() or not list(incoming.iterdir())


def test_an_archive_over_the_unpacked_limit_is_refused(people: People, catalogue: Any) -> None:
    from django.test import override_settings

    with override_settings(ADAPTER_MAX_BYTES=1000):
        archive = tar_gz({**VALID, "big.bin": b"\0" * 5000})  # compresses far below the limit
        status, code, text = error_of(people.alice.register_adapter(archive))
    assert (status, code) == (413, "payload_too_large") and "unpacks to" in text


def test_registration_needs_a_base_model(people: People, catalogue: Any) -> None:
    response = people.alice.post("/v1/models", files={"file": ("a.tgz", tar_gz(VALID))}, data={})
    assert error_of(response)[2].startswith("base_model is required")


def test_a_revision_downloads_as_a_tar_of_its_files(people: People, catalogue: Any, tmp_path: Path) -> None:
    files = {**VALID, "nested/tokenizer.json": b'{"x": 1}'}
    model = people.alice.register_adapter(tar_gz(files)).json()
    revision = model["latest_revision"]
    response = people.alice.get(revision["download_url"])
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/x-tar"
    assert int(response.headers["Content-Length"]) == len(response.content)
    assert response.headers["X-Content-SHA256"] == revision["sha256"]
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert got == files
    assert error_of(people.charlie.get(revision["download_url"])) == (
        404, "model_not_found", f"model {model['id']} does not exist in this project"
    )


def test_models_list_shows_the_projects_and_public_models_only(people: People, shipped_catalogue: None, catalogue: Any) -> None:
    mine = people.alice.register_adapter(tar_gz(VALID)).json()
    theirs = people.charlie.register_adapter(tar_gz(VALID)).json()
    listed = {m["id"] for m in people.alice.get("/v1/models", params={"page_size": 100}).json()["data"]}
    public = set(Model.objects.filter(project__isnull=True).values_list("id", flat=True))
    assert listed == public | {mine["id"]} and theirs["id"] not in listed
    adapters = people.alice.get("/v1/models", params={"kind": "adapter"}).json()["data"]
    assert [m["id"] for m in adapters] == [mine["id"]]
    for path in ("", "/revisions", "/configs", f"/revisions/{theirs['latest_revision']['id']}"):
        assert people.alice.get(f"/v1/models/{theirs['id']}{path}").status_code == 404


def test_a_prepared_models_configs_list_its_deployment_profiles(people: People, shipped_catalogue: None) -> None:
    from registry.models import SupportedBase

    glm = SupportedBase.objects.get(slug="glm-5.3")
    model = Model.objects.create(project=people.project_a, kind="prepared", name="p", base_model=glm.served_base_id, supported_base=glm)
    configs = people.alice.get(f"/v1/models/{model.id}/configs").json()["data"]
    assert [c["id"] for c in configs] == ["cr_Cf3yApYdaWMrH6RsyVmh7"] and configs[0]["quantization"] == "nvfp4"
