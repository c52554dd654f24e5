"""A second opinion from code nobody here wrote: compressed-tensors, through transformers on the CPU,
loads our checkpoints (NVFP4 converted byte for byte to its layout) and computes the same logits
as our independent reader.

compressed-tensors' CPU path dequantizes weights into plain Linear layers and does not quantize
activations, so the comparison is with our reader's weights-only model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from fp4prep.pipeline import device
from fp4prep.pipeline.export import compressed_tensors
from fp4prep.pipeline.validation import parity, reader

from ..helpers import run_tiny

IDS = list(range(300, 364))


def compressed_tensors_model(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )


@pytest.mark.parametrize(
    ("arch", "quantization"), [("llama", "nvfp4"), ("llama", "mxfp4"), ("glm4_moe", "mxfp4")]
)
def test_compressed_tensors_reads_our_checkpoint_as_our_reader_does(
    make_base, tmp_path: Path, arch: str, quantization: str
) -> None:
    out = tmp_path / "out"
    run_tiny(make_base(arch), out, quantization)
    target = out
    if quantization == "nvfp4":
        target = tmp_path / "as-compressed-tensors"
        shutil.copytree(out, target)
        compressed_tensors.to_compressed_tensors(target, target)
        assert not (target / "hf_quant_config.json").exists()
    theirs = compressed_tensors_model(target)
    weights = reader.DequantizedWeights(out, torch.bfloat16)
    ours = reader.load(out, device.resolve("cpu"), quantize_activations=False)
    theirs_state = theirs.state_dict()
    assert set(weights) | {"lm_head.weight"} >= set(theirs_state) >= set(weights)
    for name in weights:
        tensor, theirs_tensor = weights[name], theirs_state[name]
        # compressed-tensors divides by the reciprocal global scale: at most one BF16 step apart.
        assert torch.allclose(tensor.float(), theirs_tensor.float(), rtol=2**-7, atol=0), name
    diff = (parity.logits(theirs, IDS) - parity.logits(ours, IDS)).abs().max()
    assert float(diff) <= 0.05


def test_the_conversion_to_compressed_tensors_copies_bytes_and_inverts_globals(
    llama_base: Path, tmp_path: Path
) -> None:
    from ..test_run import tensors

    out = tmp_path / "out"
    run_tiny(llama_base, out, "nvfp4")
    converted = tmp_path / "ct"
    compressed_tensors.to_compressed_tensors(out, converted)
    ours, theirs = tensors(out), tensors(converted)
    modules = {k.removesuffix(".weight_scale") for k in ours if k.endswith(".weight_scale")}
    assert len(modules) == 14
    for m in modules:
        assert torch.equal(ours[f"{m}.weight"], theirs[f"{m}.weight_packed"])
        assert torch.equal(
            ours[f"{m}.weight_scale"].view(torch.uint8), theirs[f"{m}.weight_scale"].view(torch.uint8)
        )
        for mine, ct in (("weight_scale_2", "weight_global_scale"), ("input_scale", "input_global_scale")):
            assert theirs[f"{m}.{ct}"].shape == (1,)
            assert abs(float(ours[f"{m}.{mine}"]) * float(theirs[f"{m}.{ct}"]) - 1.0) < 1e-6
    unquantized = {k for k in ours if k.rpartition(".")[0] not in modules}
    assert all(torch.equal(ours[k], theirs[k]) for k in unquantized)


def test_routed_experts_input_scale_is_the_loudest_experts_in_either_layout(make_base, tmp_path: Path) -> None:
    """vLLM quantizes every routed expert's input with one scale per layer, the one of the expert that
    saw the loudest input: the largest of ModelOpt's input scales, the smallest of the global scales
    compressed-tensors stores (their reciprocals), where a dense layer's fused shards take the largest."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    run_tiny(make_base("glm4_moe"), out, "nvfp4")
    stored = load_file(out / "model.safetensors")
    spread = {k: v * (1 + int(k.split(".experts.")[1].split(".")[0])) for k, v in stored.items() if ".experts." in k and k.endswith(".input_scale")}
    assert len(spread) >= 12
    save_file({**stored, **spread}, out / "model.safetensors", metadata={"format": "pt"})
    converted = tmp_path / "ct"
    compressed_tensors.to_compressed_tensors(out, converted)
    modelopt_experts = reader.DequantizedWeights(out, torch.float32).model_activations()[1]
    ct_experts = reader.DequantizedWeights(converted, torch.float32).model_activations()[1]
    assert modelopt_experts.keys() == ct_experts.keys() and modelopt_experts
    for name, quants in modelopt_experts.items():
        layer = name.rpartition(".experts.")[0]
        leaves = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        loudest = max(float(v) for k, v in spread.items() if k.startswith(f"{layer}.experts.") and k.split(".")[-2] in leaves)
        for ours, theirs in zip(quants, ct_experts[name], strict=True):
            assert float(ours.keywords["global_scale"]) == pytest.approx(1 / loudest, rel=1e-6)
            assert float(theirs.keywords["global_scale"]) == pytest.approx(1 / loudest, rel=1e-6)
