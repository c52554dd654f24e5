"""The Python client of the fp4prep API.

    from fp4prep.client import Client

    client = Client()  # FP4PREP_API_KEY, FP4PREP_BASE_URL
    calibration = client.files.upload(file="calibration.jsonl", purpose="calibration")
    job = client.post_training.prepare_for_fp4_inference.create(
        inputs={"adapter_object_id": "ml_...", "calibration_file_id": calibration.id}
    )
"""

from .core import Client
from .errors import (
    APIConnectionError,
    APIError,
    AuthenticationError,
    BadRequestError,
    ConfigurationError,
    ConflictError,
    Fp4prepError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PaymentRequiredError,
    PermissionDeniedError,
)
from .types import (
    TERMINAL,
    DeploymentProfile,
    Estimate,
    Event,
    EventList,
    File,
    Job,
    JobResults,
    Model,
    Page,
    Project,
    Revision,
)

__all__ = [
    "TERMINAL", "APIConnectionError", "APIError", "AuthenticationError", "BadRequestError", "Client",
    "ConfigurationError", "ConflictError", "DeploymentProfile", "Estimate", "Event", "EventList", "File",
    "Fp4prepError", "InternalServerError", "Job", "JobResults", "Model", "NotFoundError", "Page",
    "PayloadTooLargeError", "PaymentRequiredError", "PermissionDeniedError", "Project", "Revision",
]
