"""Writing the checkpoint serving engines load as is.

Every format goes out through ModelOpt's unified Hugging Face export, streamed one decoder layer at
a time; formats whose layout is compressed-tensors' (MXFP4: vLLM's ModelOpt loader does not take
ModelOpt's own MXFP4 export) are then renamed into it (``compressed_tensors``). The calibrated
model's logits for the reload check are computed in the same walk (``reference``). The lineage and the
model card are written once the checkpoint passed validation (``model_card``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..formats import COMPRESSED_TENSORS
from ..model.safetensors import Entry, SafetensorsFile, rewrite_safetensors
from ..modelopt_ext.quantizers import quiet, sharing_done
from ..recipes import Recipe
from .compressed_tensors import to_compressed_tensors
from .reference import ReloadReference

# ModelOpt's streaming exporter buffers one shard in memory before writing it.
SHARD_BYTES = 1 << 30


def export(
    model: torch.nn.Module, recipe: Recipe, tokenizer: Any, output_dir: Path, reference: ReloadReference | None = None
) -> None:
    """ModelOpt's unified export, then our layout fix-ups and the tokenizer.

    On a model from ``streaming.build`` ModelOpt takes its streaming path: each decoder layer is
    materialized, quantized to its packed form and added to the current shard, then dropped. Where
    the run already gave fused groups their shared scales, that walk is the only one; ``reference``
    computes the reload check's logits in it.
    """
    from modelopt.torch.export import export_hf_checkpoint

    output_dir.mkdir(parents=True, exist_ok=True)
    walk = reference.during_export() if reference is not None else contextlib.nullcontext()
    with torch.no_grad(), quiet(), sharing_done(model), walk, bf16_as_written():
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=output_dir, max_shard_size=SHARD_BYTES)
    to_bf16(output_dir)
    tokenizer.save_pretrained(output_dir)
    if recipe.format.layout is COMPRESSED_TENSORS:
        to_compressed_tensors(output_dir, output_dir, activations=recipe.format.activations_quantized)


def _unquantized_fp32(key: str, dtype: torch.dtype) -> bool:
    """An unquantized weight or bias in FP32: a quantized weight is packed (FP4 codes in bytes, FP8)
    and scales are not named ``.weight`` or ``.bias``."""
    return key.endswith((".weight", ".bias")) and dtype in (torch.float32, torch.float64)


@contextlib.contextmanager
def bf16_as_written() -> Iterator[None]:
    """Inside, ModelOpt's streaming export casts unquantized FP32 weights to BF16 as it adds them to
    a shard (what ``to_bf16`` does afterwards), so that they are not written, read back and
    written again: on a CPU that computes in FP32 that was one and a half reads of the checkpoint."""
    from modelopt.torch.export import unified_export_hf_streaming as streaming_export

    writer = streaming_export._StreamingShardWriter
    add = writer.add

    def add_bf16(self: Any, key: str, tensor: torch.Tensor) -> None:
        add(self, key, tensor.to(torch.bfloat16) if _unquantized_fp32(key, tensor.dtype) else tensor)

    writer.add = add_bf16  # type: ignore[method-assign]
    try:
        yield
    finally:
        writer.add = add  # type: ignore[method-assign]


def to_bf16(directory: Path) -> None:
    """Cast unquantized weights that ModelOpt wrote in FP32 back to BF16, the merged model's dtype.

    ModelOpt's export writes unquantized tensors in the dtype the model computed in: FP32 on CPUs
    without native BF16, and FP32 for modules transformers keeps in FP32 (MoE routers). Their values
    are BF16 values (the merged model is BF16), so the cast is exact. Scales stay as ModelOpt wrote
    them; a shard is rewritten only if it holds such a tensor (none after a streaming export, which
    ``bf16_as_written`` casts as it goes).
    """
    for path in sorted(directory.glob("*.safetensors")):
        shard = SafetensorsFile(path)
        quantized = {k.rpartition(".")[0] for k in shard.entries if k.endswith(".weight_scale")}
        cast = {
            k
            for k in shard.entries
            if k.rpartition(".")[0] not in quantized
            and _unquantized_fp32(k, shard.dtype(k))
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
