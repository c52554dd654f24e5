"""compressed-tensors' pack-quantized layout, from ModelOpt's NVFP4 / MXFP4 export.

The packed bytes and block scales carry over unchanged; only tensor names and the config change,
and NVFP4's global scales become compressed-tensors' reciprocal ``*_global_scale`` divisors. MXFP4
checkpoints are written this way; NVFP4 ones can be (to let compressed-tensors give a second
opinion on them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import PipelineError
from ..formats import FORMATS
from ..model.safetensors import Entry, SafetensorsFile, rewrite_safetensors
from .versions import version

QUANT_CONFIG_FILE = "hf_quant_config.json"


def _fnmatch_to_ct(pattern: str) -> str:
    if not any(c in pattern for c in "*?["):
        return pattern
    return "re:" + re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".") + "$"


def scheme(modelopt_algo: str, activations: bool) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """The format's compressed-tensors name, and its weights' and inputs' quantization args."""
    fmt = next((f for f in FORMATS.values() if f.modelopt_algo == modelopt_algo.upper() and f.ct_format), None)
    if fmt is None or not fmt.e2m1:
        raise PipelineError(f"no compressed-tensors layout for {modelopt_algo}")
    e4m3 = fmt.block_scale == "e4m3"  # NVFP4: E4M3 block scales under a global one
    weights = {
        "num_bits": fmt.bits,
        "type": "float",
        "strategy": "tensor_group" if e4m3 else "group",
        "group_size": fmt.block_size,
        "symmetric": True,
        "dynamic": False,
        "scale_dtype": "torch.float8_e4m3fn" if e4m3 else "torch.uint8",
    }
    inputs = {**weights, "dynamic": "local", "observer": "static_minmax"} if e4m3 else {**weights, "dynamic": True}
    return str(fmt.ct_format), weights, inputs if activations else None


def to_compressed_tensors(src: Path, dst: Path, activations: bool = True) -> None:
    """Rewrite a ModelOpt NVFP4/MXFP4 export in compressed-tensors' pack-quantized layout.

    Exact: packed bytes and block scales are copied; NVFP4 global scales become CT's reciprocal
    ``*_global_scale`` divisors.
    """
    quant_config_path = src / QUANT_CONFIG_FILE
    modelopt_config = json.loads(quant_config_path.read_text())["quantization"]
    quant_algo = modelopt_config["quant_algo"]
    fmt, weights, inputs = scheme(quant_algo, activations)
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
        "version": version("compressed-tensors") or "0.20.1",
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
