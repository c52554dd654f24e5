"""Reading and writing Hugging Face checkpoint directories (config + safetensors).

A base may be stored as block-scaled FP8 (E4M3 weights with a ``weight_scale_inv`` per 128x128
block, as FP8 releases of large MoE models ship); ``TensorSource`` dequantizes those to BF16 on read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import UserError

FP8_BLOCK = 128
SCALE_INV_SUFFIX = "_scale_inv"


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a Hugging Face checkpoint: config.json is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} holds no .safetensors weights")
    return files


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """E4M3 weight times its per-128x128-block inverse scale, in fp32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.float() * scale[:rows, :cols]


class TensorSource:
    """Lazy access to a checkpoint's tensors by name, FP8 blocks dequantized to BF16."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._where: dict[str, Path] = {}
        for path in safetensors_files(directory):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[key] = path

    def names(self) -> list[str]:
        return [k for k in self._where if not k.endswith(SCALE_INV_SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), "pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self._where[name]), "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        tensor = self.raw(name)
        scale_name = name + SCALE_INV_SUFFIX
        if tensor.dtype == torch.float8_e4m3fn:
            if scale_name not in self._where:
                raise UserError(f"{name} is stored as FP8 without its {scale_name} block scales")
            tensor = dequantize_fp8_blocks(tensor, self.raw(scale_name))
        return tensor.to(dtype)

    def items(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name in self.names():
            by_file.setdefault(self._where[name], []).append(name)
        for names in by_file.values():
            for name in names:
                yield name, self.get(name, dtype)


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fold_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert 2-D weights (as checkpoints store them) into transformers' fused experts.

    ``experts.{e}.{gate,up}_proj.weight`` become ``experts.gate_up_proj[e]`` (gate rows first)
    and ``experts.{e}.down_proj.weight`` becomes ``experts.down_proj[e]``.
    """
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match["prefix"], {}).setdefault(int(match["e"]), {})[match["proj"]] = tensor
        else:
            out[name] = tensor
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((p["gate_proj"], p["up_proj"])) for p in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([p["down_proj"] for p in order])
    return out


def dense_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the same model stored in BF16: no quantization_config."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["torch_dtype"] = "bfloat16"
    return config


def build_model(config: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers causal LM from a config dict, holding exactly these tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = dense_config(config)
    state_dict = fold_experts(state_dict)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise UserError("config.json has no model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [_causal_lm_class(hf_config)]
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    expected = set(model.state_dict())
    tied = {k for k in expected if k not in state_dict and _is_tied(model, k)}
    missing = sorted(expected - set(state_dict) - tied)
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise UserError(
            "the checkpoint's tensors do not match its config.json: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    model.eval()
    return model


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    return key.startswith("lm_head.") and bool(getattr(model.config, "tie_word_embeddings", False))


def _causal_lm_class(hf_config: Any) -> str:
    from transformers import AutoModelForCausalLM

    model_class: Any = AutoModelForCausalLM._model_mapping[type(hf_config)]
    return str(model_class.__name__)


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
