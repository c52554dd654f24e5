"""Adapter archives built to hurt: bombs, foreign formats, lying headers, patterns that backtrack, quotas."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils.html import escape

from fp4prep.site.errors import InvalidInput, TooLarge
from registry import archives
from registry.models import Model, Revision

from ..helpers import People, error_of, lora_weights
from .test_models_api import LORA_CONFIG, VALID, tar_gz, zipped


def nothing_stored(project: Any) -> bool:
    from django.conf import settings

    incoming = settings.ARTIFACT_ROOT / "incoming"
    return not Model.objects.filter(project=project).exists() and (not incoming.exists() or not list(incoming.iterdir()))


def tar_with(name: str, size: int, data: bytes = b"", compress: bool = True) -> bytes:
    """A tar stream whose member ``name`` declares ``size`` bytes, of which ``data`` (zero-padded to
    the declared size only when it is small enough to write)."""
    info = tarfile.TarInfo(name)
    info.size = size
    raw = info.tobuf(format=tarfile.PAX_FORMAT) + data
    return gzip.compress(raw, compresslevel=1) if compress else raw


def test_a_small_archive_of_zeros_posing_as_weights_is_refused_by_its_header(people: People, catalogue: Any) -> None:
    zeros = b"\0" * (64 * 1024 * 1024)  # 64 MiB of zeros compress to about 64 KB
    archive = tar_gz({"adapter_config.json": LORA_CONFIG, "adapter_model.safetensors": zeros})
    assert len(archive) < 1024 * 1024
    status, code, message = error_of(people.alice.register_adapter(archive))
    assert (status, code) == (400, "invalid_archive")
    assert message == "adapter_model.safetensors is not a safetensors file: its header is not JSON (Expecting value at column 1)"
    assert nothing_stored(people.project_a)


def test_a_member_declaring_more_than_the_limit_is_refused_at_its_header(tmp_path: Path) -> None:
    # Only the first 64 KiB of a member that declares 4 GiB: refusing it reads no further than that.
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(tar_with("adapter_model.safetensors", 4 * 1024**3, b"\0" * 65536))
    with pytest.raises(TooLarge, match=r"adapter_model.safetensors' alone declares 4,294,967,296"):
        archives.extract(path, tmp_path / "out", max_bytes=1024**3, max_files=10)
    assert not any((tmp_path / "out").iterdir())


def test_an_extended_header_too_big_to_be_a_name_is_refused_before_it_is_read(tmp_path: Path) -> None:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 512 * 1024 * 1024
    path = tmp_path / "pax.tar.gz"
    path.write_bytes(gzip.compress(info.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * 4096, compresslevel=1))
    with pytest.raises(InvalidInput, match="extended header of 536,870,912 bytes"):
        archives.extract(path, tmp_path / "out", max_bytes=1024**3, max_files=10)


def test_the_running_unpacked_size_is_checked_as_it_grows(people: People, catalogue: Any) -> None:
    from django.test import override_settings

    files = {"adapter_config.json": LORA_CONFIG, "adapter_model.safetensors": lora_weights()}
    files.update({f"notes/{i}.txt": b"x" * 400 for i in range(10)})  # each small, together over the limit
    with override_settings(ADAPTER_MAX_BYTES=len(files["adapter_model.safetensors"]) + 2000):
        status, code, message = error_of(people.alice.register_adapter(tar_gz(files)))
    assert (status, code) == (413, "payload_too_large") and "unpacks to more than" in message
    assert nothing_stored(people.project_a)


@pytest.mark.parametrize(
    ("pack", "fmt"),
    [(bz2.compress, "bzip2"), (lzma.compress, "xz")],
)
def test_archives_compressed_with_other_formats_are_refused(people: People, catalogue: Any, pack: Any, fmt: str) -> None:
    plain = gzip.decompress(tar_gz(VALID))
    status, code, message = error_of(people.alice.register_adapter(pack(plain)))
    assert (status, code, message) == (400, "invalid_archive", f"archive is compressed with {fmt}; upload a .tar.gz, .tar or .zip")
    assert nothing_stored(people.project_a)


def test_a_plain_tar_registers(people: People, catalogue: Any) -> None:
    plain = gzip.decompress(tar_gz(VALID))
    assert people.alice.register_adapter(plain).status_code == 201


def test_a_zip_member_compressed_with_bzip2_is_refused(people: People, catalogue: Any) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("adapter_config.json", LORA_CONFIG)
        zf.writestr("adapter_model.safetensors", VALID["adapter_model.safetensors"], compress_type=zipfile.ZIP_BZIP2)
    status, code, message = error_of(people.alice.register_adapter(buffer.getvalue()))
    assert (status, code) == (400, "invalid_archive") and "compressed with method 12" in message


def test_a_zip_member_larger_than_it_declares_is_refused(people: People, catalogue: Any) -> None:
    weights = VALID["adapter_model.safetensors"]
    data = bytearray(zipped({"adapter_config.json": LORA_CONFIG, "adapter_model.notes": weights + b"tail"}))
    # Shrink the declared size in both headers, leaving the stored (uncompressed) bytes as they are.
    for header, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = data.rfind(header)
        data[at + offset : at + offset + 4] = len(weights).to_bytes(4, "little")
    status, code, message = error_of(people.alice.register_adapter(bytes(data)))
    assert (status, code) == (400, "invalid_archive") and ("larger than it declares" in message or "corrupt" in message)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (
            lora_weights({"model.layers.0.self_attn.q_proj": (128, 64)}),
            "the adapter's model.layers.0.self_attn.q_proj: it makes a 128x64 change, but the base's "
            "model.layers.0.self_attn.q_proj.weight is 64x64: the adapter was trained on another base model",
        ),
        (
            lora_weights({"model.layers.7.self_attn.q_proj": (64, 64)}),
            "the adapter targets model.layers.7.self_attn.q_proj, but the base has 2 layers",
        ),
        (
            lora_weights({"model.layers.0.self_attn.qkv_proj": (64, 64)}),
            "the adapter targets modules the base model does not have: model.layers.0.self_attn.qkv_proj",
        ),
    ],
)
def test_lora_matrices_are_checked_against_the_bases_shapes_before_they_are_stored(
    people: People, catalogue: Any, weights: bytes, message: str
) -> None:
    archive = tar_gz({"adapter_config.json": LORA_CONFIG, "adapter_model.safetensors": weights})
    assert error_of(people.alice.register_adapter(archive)) == (400, "invalid_archive", message)
    assert nothing_stored(people.project_a)


def config_with(**fields: Any) -> bytes:
    return json.dumps({**json.loads(LORA_CONFIG), **fields}).encode()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (config_with(rank_pattern={"q_proj(": 8}), "adapter_config.json: rank_pattern key 'q_proj(' is not a valid regular expression"),
        (config_with(alpha_pattern={"x" * 300: 8}), "adapter_config.json: alpha_pattern key 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx… (302 characters) is longer than 256 characters"),
        (config_with(rank_pattern={"q_proj": "eight"}), "adapter_config.json: rank_pattern['q_proj'] must be a positive number, not 'eight'"),
        (config_with(rank_pattern=["q_proj"]), "adapter_config.json: rank_pattern must be an object of module pattern -> number"),
        (config_with(r=0), "adapter_config.json: r must be a positive number, not 0"),
        # 353 bytes that compiled into 270 MiB held in the engine's cache after the answer.
        (config_with(rank_pattern={"(?:x{1024}){1024}": 8}), "adapter_config.json: rank_pattern key '(?:x{1024}){1024}' repeats too much: written out it is 1,048,576 characters, at most 4,096 are accepted"),
    ],
)
def test_adapter_configs_the_merge_cannot_apply_are_refused_naming_the_key(
    people: People, catalogue: Any, config: bytes, message: str
) -> None:
    archive = tar_gz({"adapter_config.json": config, "adapter_model.safetensors": lora_weights()})
    status, code, text = error_of(people.alice.register_adapter(archive))
    assert (status, code) == (400, "invalid_archive") and text.startswith(message), text
    assert nothing_stored(people.project_a)


def test_a_pattern_that_backtracks_in_re_registers_and_matches_at_once(people: People, catalogue: Any) -> None:
    # Python's re takes exponential time on this against a module name (about 2 s at 14 characters,
    # hours at a real module's length); the merge's matcher answers in well under a millisecond.
    from fp4prep.pipeline.inputs.adapter_files import pattern_value

    config = {"rank_pattern": {"(.*.*)*Z": 16}}
    started = time.perf_counter()
    assert pattern_value(config, "rank_pattern", "model.layers.0.self_attn.q_proj", 4) == 4
    assert time.perf_counter() - started < 0.5
    archive = tar_gz({"adapter_config.json": config_with(**config), "adapter_model.safetensors": lora_weights()})
    assert people.alice.register_adapter(archive).status_code == 201


def test_uploads_past_the_projects_storage_quota_are_refused(people: People, catalogue: Any, calibration_bytes: bytes) -> None:
    from django.test import override_settings

    archive = tar_gz(VALID)
    first = people.alice.register_adapter(archive)
    assert first.status_code == 201
    used = Revision.objects.get(pk=first.json()["latest_revision"]["id"]).size_bytes
    with override_settings(PROJECT_STORAGE_BYTES=used + 100):
        status, code, message = error_of(people.alice.register_adapter(archive))
        assert (status, code) == (413, "storage_quota_exceeded")
        assert message.startswith(f"Project {people.project_a.id} has used ") and "Nothing was stored" in message
        status, code, _ = error_of(people.alice.upload_file(calibration_bytes))
        assert (status, code) == (413, "storage_quota_exceeded")
        # Another project's quota is its own.
        assert people.charlie.register_adapter(archive).status_code == 201
    assert Model.objects.filter(project=people.project_a).count() == 1


# --- second round: cost of patterns, members counted, no 500s, no server paths ---------------------------


DEMO_MODULES = [
    f"model.layers.{i}.{m}"
    for i in range(30)
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
]


def test_plain_pattern_keys_are_looked_up_as_pythons_re_would_match_them() -> None:
    # 4096 keys PEFT-style (module names) against the demo adapter's 210 modules: a few forms of
    # key, each looked up once per module, give what re gives trying every key on every module.
    import re

    from fp4prep.pipeline.inputs.lora_patterns import PATTERN_MAX_STEPS, Patterns

    keys: dict[str, int] = {f"layers.{i}.mlp.unused_{i}": 4 for i in range(4090)}
    keys.update({"layers.3.self_attn.q_proj": 16, "q.proj": 2, "model.layers.1.mlp.down_proj": 32, "up_proj": 8})
    keys.update({r"layers\.2\d\.self_attn\.v_proj": 64, "layers.3.self_attn.q_proj.x": 1})
    patterns = Patterns({"rank_pattern": keys}, "rank_pattern")
    patterns.check_cost(DEMO_MODULES, PATTERN_MAX_STEPS)
    assert len(patterns.plain.forms) * len(DEMO_MODULES) < 20_000

    # Compiled once: re's own cache holds 512 patterns, so 4,096 keys would compile on every module.
    compiled = [(re.compile(rf"(.*\.)?({k})$"), v) for k, v in keys.items()]

    def first(module: str) -> int | None:
        return next((v for k, v in compiled if k.match(module)), None)

    got = {m: patterns.value(m, None) for m in DEMO_MODULES}
    assert got == {m: first(m) for m in DEMO_MODULES}
    assert (got["model.layers.3.self_attn.q_proj"], got["model.layers.4.self_attn.q_proj"]) == (16, 2)
    assert (got["model.layers.1.mlp.down_proj"], got["model.layers.25.self_attn.v_proj"], got["model.layers.0.mlp.up_proj"]) == (32, 64, 8)


def test_pattern_keys_that_would_cost_too_much_to_match_are_refused_naming_the_count(people: People, catalogue: Any) -> None:
    from django.test import override_settings

    keys = {rf"layers\.{i}\.nothing": 8 for i in range(4096)}  # regular expressions, each compiled and matched
    archive = tar_gz({"adapter_config.json": config_with(rank_pattern=keys), "adapter_model.safetensors": lora_weights()})
    assert error_of(people.alice.register_adapter(archive)) == (
        400, "invalid_archive",
        "adapter_config.json: rank_pattern has 4,096 keys that are regular expressions; at most 256 are accepted "
        "(plain module names such as 'layers.3.self_attn.q_proj', up to 4,096)",
    )
    some = {rf"layers\.{i}\.nothing": 8 for i in range(200)} | {f"layers.{i}.mlp.unused": 8 for i in range(100)}
    archive = tar_gz({"adapter_config.json": config_with(alpha_pattern=some), "adapter_model.safetensors": lora_weights()})
    with override_settings(ADAPTER_PATTERN_MAX_STEPS=200):
        status, code, message = error_of(people.alice.register_adapter(archive))
    assert (status, code) == (400, "invalid_archive")
    assert message.startswith(
        "adapter_config.json: alpha_pattern has 300 keys, 200 of them regular expressions and the rest plain names of 2 "
        "forms (length and dots); matching them against the adapter's 1 modules takes 202 steps, at most 200 are accepted"
    ), message
    assert nothing_stored(people.project_a)
    plain = {f"layers.{i}.mlp.unused": 8 for i in range(4096)}
    archive = tar_gz({"adapter_config.json": config_with(rank_pattern=plain), "adapter_model.safetensors": lora_weights()})
    with override_settings(ADAPTER_PATTERN_MAX_STEPS=4000):
        assert people.alice.register_adapter(archive).status_code == 201


def test_directories_count_toward_the_member_limit(people: People, catalogue: Any) -> None:
    status, code, message = error_of(people.alice.register_adapter(tar_gz(VALID, directories=20_000)))
    assert (status, code, message) == (
        400, "invalid_archive", "archive holds more than 1,000 members (files and directories); at most 1,000 are accepted"
    )
    assert nothing_stored(people.project_a)


def zip_of_directories(directories: int) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for i in range(directories):
            zf.writestr(zipfile.ZipInfo(f"d{i}/"), b"")
    return buffer.getvalue()


def test_a_zip_is_refused_by_its_central_directorys_count_before_anything_is_unpacked(tmp_path: Path) -> None:
    path = tmp_path / "dirs.zip"
    path.write_bytes(zip_of_directories(70_000))  # past 65,535: the count is in the zip64 end record
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=r"^archive holds 70,000 members \(files and directories\); at most 1,000 are accepted$"):
        archives.extract(path, out, max_bytes=1024**3, max_files=1000)
    assert not any(out.iterdir())
    # An end record that understates the count: zipfile reads as many entries as the directory's
    # size says, so that size is bounded too.
    data = bytearray(zip_of_directories(3000))
    at = data.rfind(b"PK\x05\x06")
    data[at + 8 : at + 12] = (1).to_bytes(2, "little") * 2
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match=r"^archive's central directory takes [\d,]+ bytes, more than 10 members need$"):
        archives.extract(path, out, max_bytes=1024**3, max_files=10)
    assert not any(out.iterdir())


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"x": b"1", "x/y": b"2"}, "archive member 'x/y' is inside 'x', which is a file"),
        ({"x/y": b"2", "x": b"1"}, "archive holds 'x' as a file and as a directory"),
        ({"a" * 260 + ".txt": b"1"}, "archive member 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa… (266 characters) has a name longer than 255 characters"),
        ({"d/" + "é" * 200: b"1"}, "archive member 'd/ééééééééééééééééééééééééééééééééééééé… (204 characters) has a name longer than 255 characters, or a part of it longer than 255 bytes"),
    ],
)
def test_members_that_collide_or_cannot_be_named_are_refused_without_server_paths(
    people: People, catalogue: Any, files: dict[str, bytes], message: str
) -> None:
    from django.conf import settings

    archive = tar_gz({**VALID, **files})
    status, code, text = error_of(people.alice.register_adapter(archive))
    assert (status, code) == (400, "invalid_archive") and text.startswith(message), text
    assert str(settings.ARTIFACT_ROOT) not in text and "Errno" not in text
    assert nothing_stored(people.project_a)
    page = people.alice.web.post(
        f"/projects/{people.project_a.id}/adapters/",
        {"name": "x", "base_model": "tests/tiny-llama", "file": SimpleUploadedFile("a.tar.gz", archive)},
        headers={"HX-Request": "true"},
    ).content.decode()
    assert escape(message) in page and str(settings.ARTIFACT_ROOT) not in page and "Errno" not in page


BIG = "9" * 5000


def safetensors_with_header(header: str) -> bytes:
    raw = header.encode()
    return len(raw).to_bytes(8, "little") + raw


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            {"adapter_config.json": LORA_CONFIG, "adapter_model.safetensors": safetensors_with_header(
                '{"a.lora_A.weight": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}'
            )},
            "adapter_model.safetensors: tensor 'a.lora_A.weight' is not a floating-point tensor (dtype ['F32'])",
        ),
        (
            {"adapter_config.json": LORA_CONFIG, "adapter_model.safetensors": safetensors_with_header(
                '{"a.lora_A.weight": {"dtype": "F32", "shape": [' + BIG + '], "data_offsets": [0, 4]}}'
            )},
            "adapter_model.safetensors is not a safetensors file: its header is not JSON (a number has more than 4,300 digits)",
        ),
        (
            {"adapter_config.json": b'{"peft_type": "LORA", "r": ' + BIG.encode() + b"}", "adapter_model.safetensors": lora_weights()},
            "adapter_config.json is not valid JSON: a number has more than 4,300 digits",
        ),
        (
            {"adapter_config.json": b'{"peft_type": "LORA", "r": 4, "lora_alpha": ' + BIG[:4000].encode() + b"}",
             "adapter_model.safetensors": lora_weights()},
            "adapter_config.json: lora_alpha is " + "9" * 40 + "… (4,000 characters); at most 1,000,000 is accepted",
        ),
    ],
)
def test_headers_and_configs_with_odd_json_are_400s_naming_the_field(
    people: People, catalogue: Any, files: dict[str, bytes], message: str
) -> None:
    assert error_of(people.alice.register_adapter(tar_gz(files))) == (400, "invalid_archive", message)
    assert nothing_stored(people.project_a)
