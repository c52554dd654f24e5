"""A checkpoint's config.json as the transformers config of its BF16 model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError


def dense_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the same model stored in BF16: no quantization_config."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["torch_dtype"] = "bfloat16"
    return config


def hf_config(config: dict[str, Any], name_or_path: Path | None) -> Any:
    """A transformers config object for the BF16 model of ``config`` (a causal LM), ``architectures`` set."""
    from transformers import AutoConfig

    config = dense_config(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise UserError("config.json has no model_type")
    try:
        result = AutoConfig.for_model(model_type, **config)
    except (ValueError, KeyError) as exc:
        raise UserError(f"config.json: transformers does not know model_type {model_type!r} ({exc})") from None
    if not getattr(result, "architectures", None):
        result.architectures = [_causal_lm_class(result)]
    # Export copies *.py files from here for remote-code models; never the working directory's.
    if name_or_path is not None:
        result._name_or_path = str(name_or_path)
    return result


def _causal_lm_class(config: Any) -> str:
    from transformers import AutoModelForCausalLM

    model_class: Any = AutoModelForCausalLM._model_mapping[type(config)]
    return str(model_class.__name__)
