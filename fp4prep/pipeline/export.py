"""Writing the checkpoint serving engines load as is.

NVFP4 and FP8 go out through ModelOpt's unified Hugging Face export. MXFP4 is written in
compressed-tensors' ``mxfp4-pack-quantized`` layout, because vLLM's ModelOpt loader does not accept
ModelOpt's own ``mxfp4`` export; the packed bytes and E8M0 scales carry over unchanged, only names
and the config change. ``to_compressed_tensors`` does that renaming for NVFP4 too (used to let
compressed-tensors give a second opinion on our checkpoints).
"""

from __future__ import annotations

import json
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from .checkpoint import Entry, SafetensorsFile, rewrite_safetensors
from .errors import PipelineError
from .recipes import Recipe

QUANT_CONFIG_FILE = "hf_quant_config.json"
LINEAGE_FILE = "fp4prep.json"
# ModelOpt's streaming exporter buffers one shard in memory before writing it.
SHARD_BYTES = 1 << 30


def export(model: torch.nn.Module, recipe: Recipe, tokenizer: Any, output_dir: Path) -> None:
    """ModelOpt's unified export, then our layout fix-ups and the tokenizer.

    On a model from ``streaming.build`` ModelOpt takes its streaming path: each decoder layer is
    materialized, quantized to its packed form and added to the current shard, then dropped.
    """
    from modelopt.torch.export import export_hf_checkpoint

    from .quantize import quiet

    output_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), quiet():
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=output_dir, max_shard_size=SHARD_BYTES)
    to_bf16(output_dir)
    tokenizer.save_pretrained(output_dir)
    if recipe.layout == "compressed-tensors":
        to_compressed_tensors(output_dir, output_dir, activations=recipe.activations_quantized)


def to_bf16(directory: Path) -> None:
    """Cast unquantized weights that ModelOpt wrote in FP32 back to BF16, the merged model's dtype.

    ModelOpt's streaming export writes unquantized tensors in the dtype the model computed in: FP32
    on CPUs without native BF16, and FP32 for modules transformers keeps in FP32 (MoE routers).
    Their values are BF16 values (the merged model is BF16), so the cast is exact. Scales stay as
    ModelOpt wrote them; a shard is rewritten only if it holds such a tensor.
    """
    for path in sorted(directory.glob("*.safetensors")):
        shard = SafetensorsFile(path)
        quantized = {k.rpartition(".")[0] for k in shard.entries if k.endswith(".weight_scale")}
        cast = {
            k
            for k in shard.entries
            if k.rpartition(".")[0] not in quantized
            and k.endswith((".weight", ".bias"))
            and shard.dtype(k) in (torch.float32, torch.float64)
        }
        if cast:
            entries: dict[str, Entry] = {k: shard.read(k).to(torch.bfloat16) if k in cast else k for k in shard.entries}
            rewrite_safetensors(shard, path, entries)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum(
            p.stat().st_size for p in directory.glob("*.safetensors")
        )
        index.write_text(json.dumps(data, indent=2))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _fnmatch_to_ct(pattern: str) -> str:
    if not any(c in pattern for c in "*?["):
        return pattern
    return "re:" + re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".") + "$"


def _ct_scheme(quant_algo: str, activations: bool) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    if quant_algo == "NVFP4":
        weights = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn",
        }
        inputs = {**weights, "dynamic": "local", "observer": "static_minmax"}
        return "nvfp4-pack-quantized", weights, inputs if activations else None
    if quant_algo.lower() == "mxfp4":
        weights = {
            "num_bits": 4,
            "type": "float",
            "strategy": "group",
            "group_size": 32,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        }
        return "mxfp4-pack-quantized", weights, {**weights, "dynamic": True} if activations else None
    raise PipelineError(f"no compressed-tensors layout for {quant_algo}")


def to_compressed_tensors(src: Path, dst: Path, activations: bool = True) -> None:
    """Rewrite a ModelOpt NVFP4/MXFP4 export in compressed-tensors' pack-quantized layout.

    Exact: packed bytes and block scales are copied; NVFP4 global scales become CT's reciprocal
    ``*_global_scale`` divisors.
    """
    quant_config_path = src / QUANT_CONFIG_FILE
    modelopt_config = json.loads(quant_config_path.read_text())["quantization"]
    quant_algo = modelopt_config["quant_algo"]
    fmt, weights, inputs = _ct_scheme(quant_algo, activations)
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.safetensors")):
        shard = SafetensorsFile(path)
        packed = {k[: -len(".weight_scale")] for k in shard.entries if k.endswith(".weight_scale")}
        entries: dict[str, Entry] = {}
        for key in shard.entries:
            module, _, leaf = key.rpartition(".")
            if module in packed and leaf == "weight":
                entries[f"{module}.weight_packed"] = key
            elif module in packed and leaf == "weight_scale_2":
                entries[f"{module}.weight_global_scale"] = (1.0 / shard.read(key).float()).reshape(1)
            elif module in packed and leaf == "input_scale":
                entries[f"{module}.input_global_scale"] = (1.0 / shard.read(key).float()).reshape(1)
            else:
                entries[key] = key
        rewrite_safetensors(shard, dst / path.name, entries)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = {}
        for path in sorted(dst.glob("*.safetensors")):
            weight_map.update(dict.fromkeys(SafetensorsFile(path).entries, path.name))
        data["weight_map"] = weight_map
        (dst / index.name).write_text(json.dumps(data, indent=2))
    config = json.loads((src / "config.json").read_text())
    ignore = [_fnmatch_to_ct(p) for p in modelopt_config.get("exclude_modules", [])]
    group = {
        "format": fmt,
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": inputs,
        "output_activations": None,
    }
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "version": _version("compressed-tensors") or "0.20.1",
        "config_groups": {"group_0": group},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dst == src:
        quant_config_path.unlink()  # one declared format per checkpoint


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def tool_versions() -> dict[str, str | None]:
    import fp4prep

    return {
        "fp4prep": fp4prep.__version__,
        **{p: _version(p) for p in ("nvidia-modelopt", "torch", "transformers", "peft", "safetensors")},
    }


def write_model_card(output_dir: Path, lineage: dict[str, Any]) -> None:
    """The lineage as JSON (``fp4prep.json``) and as the checkpoint's README."""
    (output_dir / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, default=str) + "\n")
    parity = lineage.get("metrics", {}).get("parity", {})
    retention = lineage.get("metrics", {}).get("retention") or {}
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [fp4prep, {lineage['recipe']['name']}, quantized]",
        "---",
        f"# {lineage.get('name') or 'Prepared model'} ({lineage['recipe']['quant_algo']})",
        "",
        "Prepared by fp4prep: the adapter was merged into the base's BF16 weights, then the merged",
        "model was calibrated and quantized with NVIDIA ModelOpt.",
        "",
        "| | |",
        "|---|---|",
        f"| base | `{lineage.get('base')}` |",
        f"| adapter | `{lineage.get('adapter')}` |",
        f"| calibration file sha256 | `{lineage.get('calibration_sha256')}` |",
        f"| recipe | `{lineage['recipe']['name']}` ({lineage['recipe']['modelopt_config']}; calibration: "
        f"{lineage['recipe']['calibration']}) |",
        f"| top-1 agreement on the BF16 model's continuations | {parity.get('continuation_top1', 0):.4f} |",
        f"| top-1 agreement / mean KL (nats) on assistant turns | {parity.get('answer_top1', 0):.4f} / {parity.get('answer_kl', 0):.4f} |",
        f"| top-1 agreement / mean KL (nats) over whole conversations | {parity.get('top1_agreement', 0):.4f} / {parity.get('mean_kl', 0):.4f} |",
        f"| identical greedy continuations | {parity.get('identical_greedy', 0):.4f} |",
        f"| adapter change retained (pooled) | {retention.get('pooled', 'n/a')} |",
        "",
        "Tool versions: " + ", ".join(f"{k} {v}" for k, v in lineage.get("tools", {}).items()),
        "",
    ]
    (output_dir / "README.md").write_text("\n".join(lines))
