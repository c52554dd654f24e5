"""The whole pipeline on a tiny dense Llama, in every format: files, layout, lineage, reload."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4prep.pipeline import STAGES, Cancelled, PipelineError, UserError
from tests.tiny import save_adapter

from .helpers import run_tiny

FORMATS = {
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    "mxfp4": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    "fp8": {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
}


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def expect_what_vllm_creates(quantization: str, t: dict[str, torch.Tensor], module: str, shape: tuple[int, int]) -> None:
    """The tensors vLLM 0.33.0 creates for a quantized linear layer of the base's ``shape`` (N, K) and
    loads from the checkpoint, dtype and shape, as its code reads: ModelOpt NVFP4 ``KNvfp4Static``/
    ``KNvfp4Dynamic`` and FP8 ``KFp8StaticChannel`` in vllm/model_executor/layers/quantization/modelopt.py
    (a per-tensor scale is one value per fused shard); compressed-tensors MXFP4
    ``CompressedTensorsW4A4Mxfp4`` in .../compressed_tensors/schemes/compressed_tensors_w4a4_mxfp4.py."""
    n, k = shape
    if quantization == "nvfp4":
        assert t[f"{module}.weight"].dtype == torch.uint8 and t[f"{module}.weight"].shape == (n, k // 2)
        assert t[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert t[f"{module}.weight_scale"].shape == (n, k // 16)
        for leaf in ("weight_scale_2", "input_scale"):
            assert t[f"{module}.{leaf}"].dtype == torch.float32 and t[f"{module}.{leaf}"].numel() == 1
    elif quantization == "mxfp4":
        assert t[f"{module}.weight_packed"].dtype == torch.uint8 and t[f"{module}.weight_packed"].shape == (n, k // 2)
        assert t[f"{module}.weight_scale"].dtype == torch.uint8 and t[f"{module}.weight_scale"].shape == (n, k // 32)
        assert f"{module}.weight" not in t and f"{module}.input_global_scale" not in t
    else:
        assert t[f"{module}.weight"].dtype == torch.float8_e4m3fn and t[f"{module}.weight"].shape == (n, k)
        assert t[f"{module}.weight_scale"].dtype == torch.float32 and t[f"{module}.weight_scale"].shape == (n,)
        assert f"{module}.input_scale" not in t  # per-token: the engine computes it


@pytest.mark.parametrize("quantization", list(FORMATS))
def test_it_prepares_a_checkpoint_engines_load_as_is(
    llama_base: Path, calibration_file: Path, tmp_path: Path, quantization: str
) -> None:
    adapter = save_adapter(
        llama_base, tmp_path / "adapter", targets=["q_proj", "k_proj", "v_proj", "o_proj"], b_scale=0.05
    )
    out = tmp_path / "out"
    result = run_tiny(
        llama_base, out, quantization, adapter_dir=adapter, calibration_file=calibration_file,
        # Hopper too for NVFP4 (the MXFP4 recipe for Blackwell is chosen only when every GPU is one).
        serving_hardware=["NVIDIA B200", "NVIDIA RTX PRO 6000 Blackwell"] + (["NVIDIA H200"] if quantization == "nvfp4" else []),
    )

    config = json.loads((out / "config.json").read_text())
    for key, value in FORMATS[quantization].items():
        assert config["quantization_config"][key] == value
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "fp4prep.json"} <= files
    assert ("hf_quant_config.json" in files) == (quantization != "mxfp4")
    assert "chat_template.jinja" in files or "chat_template" in (out / "tokenizer_config.json").read_text()

    t = tensors(out)
    quantized = sorted({k.rpartition(".")[0] for k in t if k.endswith(".weight_scale")})
    assert len(quantized) == 14  # 2 layers x q, k, v, o, gate, up, down
    base = tensors(llama_base)
    for module in quantized:
        expect_what_vllm_creates(quantization, t, module, tuple(base[f"{module}.weight"].shape))
    for parent in {m.rpartition(".")[0] for m in quantized}:
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            for leaf in ("weight_scale_2", "input_scale", "weight_global_scale"):
                # vLLM runs a fused group as one GEMM with the largest of its global scales (and
                # warns when they differ): they must be equal.
                values = {float(t[f"{parent}.{g}.{leaf}"]) for g in group if f"{parent}.{g}.{leaf}" in t}
                assert len(values) <= 1, (parent, group, leaf, values)
    if quantization != "mxfp4":
        qc = config["quantization_config"]
        assert isinstance(qc.get("ignore", qc.get("exclude_modules")), list)
        # vLLM takes an absent group_size as 16 (ModelOptNvFp4Config); ModelOpt's export writes it
        # inside config_groups, which vLLM's ModelOpt loader does not read.
        assert qc.get("group_size") in (None, 16)
    else:
        (group,) = config["quantization_config"]["config_groups"].values()
        expected = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}
        assert {key: group["weights"].get(key) for key in expected} == expected
        assert group["input_activations"] is None
    # lm_head, embeddings and norms stay BF16, with no scale tensors beside them.
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert t[name].dtype == torch.bfloat16
    assert not any(k.startswith("lm_head.") and k != "lm_head.weight" for k in t)
    assert result.reload_max_logit_diff == 0.0
    assert result.retention is not None and 0.8 < result.retention.pooled < 1.2
    assert result.corpus.user_tokens == 1024 and result.corpus.general_tokens == 1024
    assert result.corpus.held_out_conversations == 12
    parity = result.parity
    # The metrics themselves are checked in test_parity_metrics and on the demo (test_parity_gate);
    # here: every held-back conversation was compared, on its answers inside the whole of it.
    assert parity.prompts == 3 and 0 < parity.answer_tokens < parity.tokens

    lineage = json.loads((out / "fp4prep.json").read_text())
    assert lineage["calibration_sha256"] == result.corpus.calibration_sha256
    assert len(lineage["calibration_sha256"]) == 64
    assert lineage["recipe"]["name"] == quantization
    # How it was calibrated is on record and in the model card: NVFP4 by AWQ then GPTQ, MXFP4 for
    # Blackwell by AWQ on its quantized inputs then GPTQ, FP8 by max.
    expected = {
        "nvfp4": "AWQ search (alpha step 0.5), scales folded into the preceding norms and projections, "
                 "then GPTQ against static weight scales in activation order",
        # Served on Blackwell only (below), where vLLM quantizes MXFP4 inputs: calibrated for them.
        "mxfp4": "AWQ search (alpha step 0.5), scales folded into the preceding norms and projections, "
                 "then GPTQ against each block's own scale in activation order, with the inputs quantized to MXFP4 as vLLM does on Blackwell",
    }
    assert lineage["recipe"]["calibration"] == expected.get(quantization, "max")
    card = (out / "README.md").read_text()
    assert f"calibration: {lineage['recipe']['calibration']}" in card
    # How to serve it, and no claim that transformers loads it (it does not load these layouts).
    assert "## Serving" in card and "`vllm serve <this directory>`" in card and "library_name" not in card
    assert lineage["recipe"]["activation_arithmetic"] == (None if quantization == "mxfp4" else "vLLM 0.33.0")
    assert lineage["tools"]["nvidia-modelopt"] == importlib.metadata.version("nvidia-modelopt")
    assert lineage["metrics"]["parity"] == dataclasses.asdict(parity)  # the record is the result
    # Where the engine computes other than the checkpoint declares (MXFP4 on Blackwell: W4A4, the
    # same on compute capability 12 without routed experts; NVFP4 on Hopper: W4A16), the run measured
    # it that way too, on the same prompts; elsewhere nothing more.
    if quantization == "nvfp4":
        (served,) = result.serving
        assert served.numerics == "nvfp4-w4a16" and served.hardware == ["NVIDIA H200"]
        assert served.parity.prompts == parity.prompts and served.parity.answer_kl != parity.answer_kl
        assert "| Served on NVIDIA H200: top-1" in card
    elif quantization == "mxfp4":
        (served,) = result.serving
        assert served.numerics == "mxfp4-w4a4"
        assert served.hardware == ["NVIDIA B200", "NVIDIA RTX PRO 6000 Blackwell"]
        assert served.parity.prompts == parity.prompts and served.parity.answer_tokens == parity.answer_tokens
        assert served.parity.answer_kl != parity.answer_kl
        assert served.misses == [] and "| Served on NVIDIA B200, NVIDIA RTX PRO 6000 Blackwell: top-1" in card
        assert any(c.startswith("served on NVIDIA B200, NVIDIA RTX PRO 6000 Blackwell: vLLM 0.33") for c in result.checks)
    else:
        assert result.serving == []
    assert not any(p.name.startswith(".fp4prep-") for p in tmp_path.iterdir())


def test_without_an_adapter_the_base_itself_is_prepared(llama_base: Path, tmp_path: Path) -> None:
    result = run_tiny(llama_base, tmp_path / "out")
    assert result.retention is None
    assert result.corpus.user_tokens == 0 and result.corpus.general_tokens == 2048
    assert result.parity.prompts == 3


def test_progress_goes_through_every_stage_in_order(llama_base: Path, tmp_path: Path) -> None:
    seen: list[tuple[str, float]] = []
    run_tiny(llama_base, tmp_path / "out", progress=lambda stage, f: seen.append((stage, f)))
    stages = [s for i, (s, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != s]
    assert stages == list(STAGES)
    for stage in STAGES:
        fractions = [f for s, f in seen if s == stage]
        assert fractions[0] == 0.0 and fractions[-1] == 1.0
        assert fractions == sorted(fractions)
    calibration_updates = [f for s, f in seen if s == "calibrating"]
    assert len(calibration_updates) > 4  # reported inside the loop, not only at its ends


@pytest.mark.parametrize("stage", ["merging", "calibrating", "validating"])
def test_a_cancelled_run_stops_and_leaves_nothing(llama_base: Path, tmp_path: Path, stage: str) -> None:
    current = {"stage": ""}

    def progress(s: str, fraction: float) -> None:
        current["stage"] = s

    def should_cancel() -> bool:
        return current["stage"] == stage

    with pytest.raises(Cancelled, match=f"during {stage}"):
        run_tiny(llama_base, tmp_path / "out", progress=progress, should_cancel=should_cancel)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == [llama_base]


def test_it_refuses_a_non_empty_output_directory(llama_base: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists and is not empty"):
        run_tiny(llama_base, out)
    assert (out / "keep.txt").read_text() == "mine"


def test_an_unknown_format_is_a_user_error(llama_base: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown quantization 'int3'"):
        run_tiny(llama_base, tmp_path / "out", "int3")


def test_a_checkpoint_that_misses_its_thresholds_is_an_error_not_a_result(
    llama_base: Path, tmp_path: Path
) -> None:
    from fp4prep.pipeline import Thresholds

    impossible = Thresholds(
        continuation_top1=1.01,
        answer_kl=0.0,
        identical_greedy=1.01,
        adapter_retention=0.5,
        reload_max_logit_diff=1e-3,
    )
    with pytest.raises(PipelineError, match="missed its quality thresholds: top-1 agreement on the BF16"):
        run_tiny(llama_base, tmp_path / "out", thresholds=impossible)
    assert not (tmp_path / "out").exists()


def rchar() -> int:
    """Bytes this process has read through read(2) and its kin so far, page-cache hits included."""
    line = next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:"))
    return int(line.split()[1])


def test_a_run_counts_what_it_reads_from_the_base_and_the_checkpoint(llama_base: Path, tmp_path: Path) -> None:
    from fp4prep.pipeline.model.reads import ReadTally, safetensors_bytes, tallying
    from fp4prep.pipeline.model.safetensors import SafetensorsFile, TensorSource

    # Reading every tensor once is one pass over the tensors' bytes: the file less its header.
    (weights,) = llama_base.glob("*.safetensors")
    header = SafetensorsFile(weights).data_start
    tally = ReadTally({"base": llama_base}, lambda: "reading")
    source = TensorSource(llama_base)
    with tallying(tally):
        for name in source.names():
            source.raw(name)
    size = weights.stat().st_size
    assert tally.bytes == {"base": {"reading": size - header}}
    assert tally.report({"base": size})["base"]["total_passes"] == round((size - header) / size, 2)

    before = rchar()
    result = run_tiny(llama_base, tmp_path / "out")
    read_by_process = rchar() - before
    reads = result.reads
    assert reads["base"]["size_bytes"] == size
    assert reads["checkpoint"]["size_bytes"] == safetensors_bytes(tmp_path / "out")
    for side in ("base", "checkpoint"):
        assert set(reads[side]["read_bytes"]) <= set(STAGES)
        for stage, n in reads[side]["read_bytes"].items():
            assert reads[side]["passes"][stage] == round(n / reads[side]["size_bytes"], 2)
    # Every base tensor is read at least once to quantize and export (the embeddings when the model
    # is built, the layers to calibrate, the output head for the reload check's reference) and once
    # more for the BF16 side of validation; the checkpoint only once it exists, and in validation at
    # least once whole (structure, reload).
    before_validation = sum(reads["base"]["read_bytes"].get(s, 0) for s in STAGES if s != "validating")
    assert before_validation >= size - header and reads["base"]["passes"]["validating"] >= 0.9, reads
    assert set(reads["checkpoint"]["read_bytes"]) <= {"exporting", "validating"}, reads
    assert reads["checkpoint"]["passes"]["validating"] >= 1, reads
    # What the tally counts the process did read with pread (the kernel's count holds every other
    # file too; the weights calibration wrote back are read through a map, which it does not see).
    counted = sum(sum(reads[side]["read_bytes"].values()) for side in ("base", "checkpoint"))
    assert counted <= read_by_process
    lineage = json.loads((tmp_path / "out" / "fp4prep.json").read_text())
    assert lineage["metrics"]["reads"] == reads


def test_finding_the_fused_groups_reads_no_weights_and_changes_no_byte(
    llama_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ModelOpt finds which projections share an input (to give them one global scale) by a forward
    # whose values it throws away. Run on zeros of the weights' shapes, it reads none of the weights
    # calibration changed, and the checkpoint is byte for byte the one the forward on the real
    # weights gives.
    from fp4prep.pipeline.model.lazy import LazyWeights

    on_zeros = run_tiny(llama_base, tmp_path / "zeros")
    monkeypatch.setattr(LazyWeights, "shapes_only", lambda self, shapes: contextlib.nullcontext())
    on_weights = run_tiny(llama_base, tmp_path / "weights")
    # Nothing is left to read while quantizing; export reads the changed weights once, and the
    # reload check's reference is computed in the same walk (the reader matches it exactly).
    assert "quantizing" not in on_zeros.reads["written"]["passes"], on_zeros.reads
    assert on_weights.reads["written"]["passes"]["quantizing"] == 1.0, on_weights.reads
    for result in (on_zeros, on_weights):
        assert result.reads["written"]["passes"]["exporting"] == 1.0, result.reads
        assert result.reload_max_logit_diff == 0.0
    for path in (tmp_path / "weights").glob("*.safetensors"):
        assert (tmp_path / "zeros" / path.name).read_bytes() == path.read_bytes(), path.name
