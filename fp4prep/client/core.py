"""``Client``: the REST API over HTTP, with typed results and typed errors.

Calls that are safe to repeat are retried with exponential backoff on connection errors, 5xx and
429 (after the server's Retry-After): reads, estimates (which never hold or charge) and creates,
which carry an Idempotency-Key so that a repeat returns the first job. Uploads and cancels are
sent once.
"""

from __future__ import annotations

import builtins
import os
import tarfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import requests

from .errors import APIConnectionError, ConfigurationError, error_for
from .types import (
    ApiKey,
    DeploymentProfile,
    Estimate,
    EventList,
    File,
    Job,
    Model,
    Page,
    Project,
    Revision,
    parse,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
JOBS = "/v1/post-training/prepare-for-fp4-inference"
RETRY_STATUSES = {429, 500, 502, 503, 504}
RETRY_AFTER_MAX = 30.0
FileInput = str | os.PathLike[str] | IO[bytes]


class Client:
    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 2,
        backoff: float = 0.5,
    ) -> None:
        self.api_key = api_key or os.environ.get("FP4PREP_API_KEY", "")
        if not self.api_key:
            raise ConfigurationError("no API key: pass api_key= or set FP4PREP_API_KEY")
        self.base_url = (base_url or os.environ.get("FP4PREP_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigurationError(f"base URL {self.base_url!r} must start with http:// or https://")
        self.timeout, self.max_retries, self.backoff = timeout, max_retries, backoff
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {self.api_key}", "User-Agent": "fp4prep-client"})
        self.files = Files(self)
        self.keys = Keys(self)
        self.models = Models(self)
        self.post_training = PostTraining(self)

    def whoami(self) -> Project:
        return parse(Project, self.request("GET", "/v1/whoami").json())

    def request(self, method: str, path: str, *, retry: bool | None = None, **kwargs: Any) -> requests.Response:
        """One API call; raises the typed error for a 4xx/5xx. ``retry`` defaults to GET only."""
        retry = method == "GET" if retry is None else retry
        attempts = 1 + (self.max_retries if retry else 0)
        url = path if path.startswith("http") else self.base_url + path
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                response = self.session.request(method, url, timeout=self.timeout, **kwargs)
            except (requests.ConnectionError, requests.Timeout) as exc:
                if last:
                    raise APIConnectionError(f"could not reach {self.base_url}: {_reason(exc)}") from None
            else:
                if response.status_code < 400:
                    return response
                if last or response.status_code not in RETRY_STATUSES:
                    raise _api_error(response)
                wait = _retry_after(response)
                if wait is not None:
                    time.sleep(wait)
                    continue
            time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")


def _retry_after(response: requests.Response) -> float | None:
    try:
        return min(float(response.headers["Retry-After"]), RETRY_AFTER_MAX)
    except (KeyError, ValueError):
        return None


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    if isinstance(exc, requests.Timeout):
        return "timed out"
    return text.splitlines()[0][:200]


def _api_error(response: requests.Response) -> Exception:
    code, message = "", ""
    try:
        body = response.json()
        code, message = body["error"].get("code", ""), body["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = f"{response.status_code} {response.reason}" + (f": {response.text[:200]}" if response.text else "")
    return error_for(response.status_code, code, message)


def _opened(file: FileInput) -> tuple[str, IO[bytes], bool]:
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        return path.name, path.open("rb"), True
    return Path(getattr(file, "name", "upload")).name, file, False


class Keys:
    """The project's API keys. Making one takes a key of the full scope."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, name: str = "", scope: str = "full") -> ApiKey:
        """A new key; its ``key`` is the secret, returned this once."""
        return parse(ApiKey, self._client.request("POST", "/v1/keys", json={"name": name, "scope": scope}).json())

    def list(self, page: int | None = None) -> Page[ApiKey]:
        return Page.of(ApiKey, self._client.request("GET", "/v1/keys", params=_page(page)).json())


class Files:
    def __init__(self, client: Client) -> None:
        self._client = client

    def upload(self, file: FileInput, purpose: str = "calibration") -> File:
        """Upload and validate; a file that fails validation comes back with ``status == "error"``
        and its report (line numbers and messages)."""
        name, stream, owned = _opened(file)
        try:
            response = self._client.request("POST", "/v1/files", files={"file": (name, stream)}, data={"purpose": purpose})
        finally:
            if owned:
                stream.close()
        return parse(File, response.json())

    def list(self, page: int | None = None) -> Page[File]:
        return Page.of(File, self._client.request("GET", "/v1/files", params=_page(page)).json())

    def retrieve(self, file_id: str) -> File:
        return parse(File, self._client.request("GET", f"/v1/files/{file_id}").json())


class Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self, kind: str | None = None, page: int | None = None) -> Page[Model]:
        params = {**_page(page), **({"kind": kind} if kind else {})}
        return Page.of(Model, self._client.request("GET", "/v1/models", params=params).json())

    def retrieve(self, model_id: str) -> Model:
        return parse(Model, self._client.request("GET", f"/v1/models/{model_id}").json())

    def revisions(self, model_id: str, page: int | None = None) -> Page[Revision]:
        return Page.of(Revision, self._client.request("GET", f"/v1/models/{model_id}/revisions", params=_page(page)).json())

    def revision(self, model_id: str, revision_id: str) -> Revision:
        return parse(Revision, self._client.request("GET", f"/v1/models/{model_id}/revisions/{revision_id}").json())

    def configs(self, model_id: str) -> builtins.list[DeploymentProfile]:
        body = self._client.request("GET", f"/v1/models/{model_id}/configs").json()
        return [parse(DeploymentProfile, row) for row in body["data"]]

    def register_adapter(self, file: FileInput, base_model: str, name: str = "", model_id: str | None = None) -> Model:
        """Register a PEFT LoRA adapter archive (.tar.gz, .tar or .zip), or add a revision to ``model_id``."""
        archive, stream, owned = _opened(file)
        data = {"base_model": base_model, "name": name, **({"model_id": model_id} if model_id else {})}
        try:
            response = self._client.request("POST", "/v1/models", files={"file": (archive, stream)}, data=data)
        finally:
            if owned:
                stream.close()
        return parse(Model, response.json())

    def download(
        self,
        model_id: str,
        revision_id: str,
        to: str | os.PathLike[str],
        *,
        extract: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> Path:
        """Stream the revision's .tar to ``to`` (a directory to unpack into, or the .tar's path with
        ``extract=False``); checks the length the server announced. ``progress(done, total)``."""
        target = Path(to)
        response = self._client.request("GET", f"/v1/models/{model_id}/revisions/{revision_id}/download", stream=True)
        total = int(response.headers.get("Content-Length") or 0)
        tar_path = target.with_name(target.name + ".tar.part") if extract else target.with_name(target.name + ".part")
        tar_path.parent.mkdir(parents=True, exist_ok=True)
        done = 0
        try:
            with response, tar_path.open("wb") as out:
                for chunk in response.iter_content(1024 * 1024):
                    out.write(chunk)
                    done += len(chunk)
                    if progress:
                        progress(done, total)
            if total and done != total:
                raise APIConnectionError(f"the download stopped after {done:,} of {total:,} bytes; run it again")
            if not extract:
                tar_path.replace(target)
                return target
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tar_path) as tar:
                tar.extractall(target, filter="data")  # refuses links out of and paths above target
            return target
        finally:
            tar_path.unlink(missing_ok=True)


class PrepareForFP4Inference:
    """``client.post_training.prepare_for_fp4_inference``: estimate, create, watch and cancel jobs."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def estimate_cost(self, inputs: dict[str, Any]) -> Estimate:
        # Never holds or charges, so it is safe to repeat.
        response = self._client.request("POST", f"{JOBS}/estimate", json={"inputs": inputs}, retry=True)
        return parse(Estimate, response.json())

    def create(self, inputs: dict[str, Any], idempotency_key: str | None = None) -> Job:
        """Create a job. It carries an Idempotency-Key (a new UUID unless given), so it is retried
        like a read: a retry that reaches the server twice gets the first job back, held once."""
        key = idempotency_key or str(uuid.uuid4())
        response = self._client.request("POST", JOBS, json={"inputs": inputs}, retry=True, headers={"Idempotency-Key": key})
        return parse(Job, response.json())

    def retrieve(self, job_id: str) -> Job:
        return parse(Job, self._client.request("GET", f"{JOBS}/{job_id}").json())

    def list(self, status: str | None = None, page: int | None = None) -> Page[Job]:
        params = {**_page(page), **({"status": status} if status else {})}
        return Page.of(Job, self._client.request("GET", JOBS, params=params).json())

    def list_events(self, job_id: str, after: int | None = None) -> EventList:
        params = {"after": after} if after is not None else {}
        return parse(EventList, self._client.request("GET", f"{JOBS}/{job_id}/events", params=params).json())

    def cancel(self, job_id: str) -> Job:
        return parse(Job, self._client.request("POST", f"{JOBS}/{job_id}/cancel").json())


class PostTraining:
    def __init__(self, client: Client) -> None:
        self.prepare_for_fp4_inference = PrepareForFP4Inference(client)


def _page(page: int | None) -> dict[str, Any]:
    return {"page": page} if page else {}
