"""One decoder layer at a time: memory that does not grow with depth, resume to the same bytes,
FP32 compute where BF16 is slow, local runs that keep their output, limits checked before work."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4prep.pipeline import Cancelled, PipelineError, device
from fp4prep.pipeline.errors import InternalError
from fp4prep.pipeline.model.safetensors import TensorSource
from fp4prep.pipeline.recipes import RECIPES, AwqSearch
from tests.tiny import save_adapter, tiny_config

from ..bases import random_llama, sparse_llama
from ..helpers import TINY, run_tiny

# The one thing a run keeps for every decoder layer is validation's prompt cache (each parity
# prompt's keys and values), by design and within a budget fixed apart from depth (``kv_budget``):
# the child gives it none, so that what grows with depth here is only what streaming holds. Its
# recipe is NVFP4's GPTQ step alone, whose Hessians are what a layer's calibration holds most of
# beside the weights; the AWQ search before it, which holds one layer's inputs as every stage does,
# would take a fifth more time (2-core AVX2-only CPU).
RUN_IN_CHILD = """
import dataclasses, json, sys
from fp4prep.pipeline import RECIPES, PipelineConfig, run
from fp4prep.pipeline.recipes import Gptq
from fp4prep.pipeline.validation import first_round, parity
first_round.kv_budget = parity.kv_budget = lambda model: 0
gptq = dataclasses.replace(RECIPES["nvfp4"], steps=tuple(s for s in RECIPES["nvfp4"].steps if isinstance(s, Gptq)))
result = run(PipelineConfig(
    base_dir=sys.argv[1], output_dir=sys.argv[2], calibration_tokens=1024, sequence_length=256,
    parity_prompts=4, continuation_tokens=4, quality_gate=False, recipe=gptq,
))
print(json.dumps({"reload_max_logit_diff": result.reload_max_logit_diff}))
"""


def peak_rss_of_a_run(base: Path, out: Path, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """The pipeline in a child process: its peak resident set in bytes and a bit of its result."""
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as o, stderr.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-c", RUN_IN_CHILD, str(base), str(out)], stdout=o, stderr=e)
        _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, stderr.read_text()[-3000:]
    return usage.ru_maxrss * 1024, json.loads(stdout.read_text())


def test_peak_memory_does_not_grow_with_depth(tmp_path: Path, tokenizer_dir: Path) -> None:
    # Weights dominate each layer (14 MiB in BF16), as in real models; kept square so that GPTQ's
    # Hessians (one per input a layer reads) stay small beside them.
    hidden, intermediate = 1024, 1024
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    peaks = {}
    for layers in (4, 20):
        base = random_llama(tmp_path / f"base{layers}", tokenizer_dir, layers, hidden, intermediate)
        peaks[layers], result = peak_rss_of_a_run(base, tmp_path / f"out{layers}", tmp_path)
        assert result["reload_max_logit_diff"] == 0.0
    extra = 16 * layer_bytes  # what holding the 16 extra layers once would add, in BF16
    print(f"peak RSS by depth: {peaks}; growth {(peaks[20] - peaks[4]) >> 20} MiB, bar {(extra // 4) >> 20} MiB")
    assert peaks[20] - peaks[4] < extra / 4, (peaks, extra)


def cancel_at(stage: str, fraction: float) -> tuple[Any, Any]:
    """A progress callback and a cancellation check that stop a run once it gets that far."""
    seen: dict[str, Any] = {"stage": None, "fraction": 0.0}

    def progress(s: str, f: float) -> None:
        seen.update(stage=s, fraction=f)

    def should_cancel() -> bool:
        return seen["stage"] == stage and seen["fraction"] >= fraction

    return progress, should_cancel


def checkpoint_bytes(directory: Path) -> dict[str, bytes]:
    # fp4prep.json and README.md carry the run's own lineage (times, resume point): not the checkpoint.
    return {
        p.name: p.read_bytes() for p in directory.iterdir() if p.name not in ("fp4prep.json", "README.md")
    }


def six_layer_base(base: Path, tokenizer_dir: Path, arch: str = "llama") -> Path:
    """A tiny random base deep enough that a run stopped halfway has finished layers to resume from."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    config.num_hidden_layers = 6
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(base)
    for f in tokenizer_dir.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    return base


@pytest.mark.parametrize(
    ("arch", "stage", "fraction"),
    [("llama", "calibrating", 0.5), ("glm4_moe", "calibrating", 0.5), ("mixtral", "calibrating", 0.5), ("llama", "exporting", 0.0),
     # Export done: the reload check's reference comes from a forward of its own, not export's walk.
     ("llama", "validating", 0.0)],
)
def test_a_run_stopped_midway_resumes_and_writes_the_same_checkpoint_bytes(
    tmp_path: Path, tokenizer_dir: Path, calibration_file: Path, arch: str, stage: str, fraction: float
) -> None:
    base = six_layer_base(tmp_path / "base", tokenizer_dir, arch)
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "o_proj"], b_scale=0.05)
    common: dict[str, Any] = {"adapter_dir": adapter, "calibration_file": calibration_file}
    if arch != "llama":  # the whole recipe on routed experts: their AWQ search and fold too
        recipe = RECIPES["nvfp4"]
        common["recipe"] = dataclasses.replace(recipe, steps=(AwqSearch(routed_experts=True), *recipe.steps[1:]))

    straight = run_tiny(base, tmp_path / "straight", **common)
    assert straight.resumed_from_layer is None

    work = tmp_path / "work"
    progress, should_cancel = cancel_at(stage, fraction)
    with pytest.raises(Cancelled):
        run_tiny(base, tmp_path / "resumed", work_dir=work, progress=progress, should_cancel=should_cancel, **common)
    assert not (tmp_path / "resumed").exists()
    notes: list[str] = []
    resumed = run_tiny(base, tmp_path / "resumed", work_dir=work, notify=notes.append, **common)

    if stage == "calibrating":
        assert resumed.resumed_from_layer is not None and 0 < resumed.resumed_from_layer < 6
        assert notes == [
            f"Resuming calibration at layer {resumed.resumed_from_layer + 1} of 6: "
            f"an earlier run finished layers 1-{resumed.resumed_from_layer}"
        ]
    else:
        assert resumed.resumed_from_layer == 6
        assert notes == ["Resuming: every layer was calibrated by an earlier run (6 layers)"]
    assert checkpoint_bytes(tmp_path / "resumed") == checkpoint_bytes(tmp_path / "straight")
    assert resumed.expert_tokens == straight.expert_tokens
    assert resumed.expert_gptq == straight.expert_gptq
    if arch != "llama":  # every MoE layer's routed experts were rounded by GPTQ, resumed or not
        assert len(straight.expert_gptq) == sum(1 for i in range(6) if arch == "mixtral" or i > 0)
        assert all(kept == 0 and done > 0 for done, kept in straight.expert_gptq.values())
    assert resumed.parity == straight.parity and resumed.reload_max_logit_diff == 0.0
    assert list(work.iterdir()) == []  # a finished run leaves nothing to resume


def test_calibration_writes_each_changed_weight_once_and_checkpoints_only_the_quantizers(
    tmp_path: Path, tokenizer_dir: Path, calibration_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A layer's changed weights go to written/ before ModelOpt commits the layer, once each;
    # ModelOpt's per-layer checkpoint keeps the quantizers, not another copy of the weights.
    import safetensors.torch

    base = six_layer_base(tmp_path / "base", tokenizer_dir)
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "o_proj"], b_scale=0.05)
    saves: dict[str, int] = {}
    save_file = safetensors.torch.save_file

    def counted(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> Any:
        path = Path(filename)
        if path.parent.name == "written":
            saves[path.stem] = saves.get(path.stem, 0) + 1
        return save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", counted)
    work = tmp_path / "work"
    progress, should_cancel = cancel_at("calibrating", 0.8)  # the last layers: the others' state kept
    with pytest.raises(Cancelled):
        run_tiny(base, tmp_path / "out", work_dir=work, adapter_dir=adapter, calibration_file=calibration_file,
                 progress=progress, should_cancel=should_cancel)
    layers = sorted((work / "calibration").glob("layer_*"))
    assert len(layers) >= 4, layers
    for layer in layers:
        assert (layer / "quantizer_buffers.pt").is_file() and not (layer / "weights.pt").exists()
    written = {p.stem for p in (work / "written").glob("*.safetensors")}
    assert written and set(saves) == written and set(saves.values()) == {1}, saves


def test_a_layer_cut_short_is_calibrated_again_from_its_merged_weights(
    tmp_path: Path, tokenizer_dir: Path, calibration_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An error in layer 2's steps after its scales were folded into its weights: the folded weights
    # are written back as the layer is put away, but no checkpoint commits the layer. The run that
    # resumes calibrates layer 2 again from the merged weights, not from the folded ones.
    base = six_layer_base(tmp_path / "base", tokenizer_dir)
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "o_proj"], b_scale=0.05)
    common: dict[str, Any] = {"adapter_dir": adapter, "calibration_file": calibration_file}
    straight = run_tiny(base, tmp_path / "straight", **common)

    from fp4prep.pipeline.algorithms import gptq

    rounding = gptq.quantize_layer

    def fails_on_layer_2(layer: torch.nn.Module, hessians: Any, prefix: str, *args: Any) -> Any:
        if prefix.endswith(".2."):
            raise RuntimeError("out of memory (simulated)")
        return rounding(layer, hessians, prefix, *args)

    monkeypatch.setattr(gptq, "quantize_layer", fails_on_layer_2)
    work = tmp_path / "work"
    with pytest.raises(InternalError, match="simulated"):
        run_tiny(base, tmp_path / "resumed", work_dir=work, **common)
    assert any(".layers.2." in p.name for p in (work / "written").iterdir())  # the folded weights
    monkeypatch.setattr(gptq, "quantize_layer", rounding)

    resumed = run_tiny(base, tmp_path / "resumed", work_dir=work, **common)
    assert resumed.resumed_from_layer == 2
    assert checkpoint_bytes(tmp_path / "resumed") == checkpoint_bytes(tmp_path / "straight")
    assert resumed.parity == straight.parity


def test_a_work_directory_from_other_inputs_is_not_resumed(
    llama_base: Path, tmp_path: Path, calibration_file: Path
) -> None:
    work = tmp_path / "work"
    progress, should_cancel = cancel_at("exporting", 0.0)
    with pytest.raises(Cancelled):
        run_tiny(llama_base, tmp_path / "a", work_dir=work, progress=progress, should_cancel=should_cancel)
    result = run_tiny(llama_base, tmp_path / "b", "mxfp4", work_dir=work, calibration_file=calibration_file)
    assert result.resumed_from_layer is None and result.quantization == "mxfp4"


def test_without_native_bf16_the_cpu_computes_in_fp32_and_ships_bf16(
    llama_base: Path, tmp_path: Path, calibration_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FP4PREP_CPU_BF16", "0")
    assert device.resolve("auto") == device.Compute(torch.device("cpu"), torch.float32)
    out = tmp_path / "out"
    result = run_tiny(llama_base, out, calibration_file=calibration_file)
    assert result.device == "cpu, float32"
    assert result.reload_max_logit_diff == 0.0  # the reader reproduces the FP32 calibrated model exactly
    source = TensorSource(out)
    quantized = {n.removesuffix(".weight_scale") for n in source.names() if n.endswith(".weight_scale")}
    unquantized = [n for n in source.names() if n.rpartition(".")[0] not in quantized]
    assert {source.stored_dtype(n) for n in unquantized} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # Cast as the export writes them: the checkpoint is not read back to cast it afterwards.
    assert "exporting" not in result.reads["checkpoint"]["read_bytes"], result.reads


def test_devices_are_named_as_the_command_line_takes_them() -> None:
    from fp4prep.pipeline import UserError

    assert device.resolve("cpu").device == torch.device("cpu")
    with pytest.raises(UserError, match="unknown device 'tpu': use auto, cpu, cuda or cuda:N"):
        device.resolve("tpu")
    if not torch.cuda.is_available():
        assert device.resolve("auto").device == torch.device("cpu")
        with pytest.raises(UserError, match="this machine has no usable CUDA device"):
            device.resolve("cuda:0")


def test_without_the_quality_gate_a_miss_is_written_and_recorded(llama_base: Path, tmp_path: Path) -> None:
    impossible = TINY.__class__(**{**TINY.__dict__, "continuation_top1": 1.01})
    with pytest.raises(PipelineError, match=r"missed its quality thresholds: top-1 agreement on the BF16 model's own continuations .* < 1\.01"):
        run_tiny(llama_base, tmp_path / "gated", thresholds=impossible)
    assert not (tmp_path / "gated").exists()

    out = tmp_path / "kept"
    result = run_tiny(llama_base, out, thresholds=impossible, quality_gate=False)
    assert len(result.quality_misses) == 1 and result.quality_misses[0].endswith("< 1.01")
    lineage = json.loads((out / "fp4prep.json").read_text())
    assert lineage["quality_gate"] == {"enforced": False, "misses": result.quality_misses}
    assert (out / "model.safetensors").is_file()


def test_a_layer_too_big_for_the_device_is_refused_before_any_work(tmp_path: Path, tokenizer_dir: Path) -> None:
    # One layer whose weights alone are about the machine's free memory: holding it twice can't fit.
    free = device.available_memory(torch.device("cpu"))
    hidden = 4096
    intermediate = 256 * (free // (3 * hidden * 2 * 256) + 1)
    base = sparse_llama(tmp_path / "huge-layer", tokenizer_dir, 1, hidden, intermediate)
    stages: list[str] = []
    with pytest.raises(PipelineError, match=r"can't be prepared on cpu even one decoder layer at a time: it needs about [\d.]+ [GT]iB there \(its largest layer is [\d.]+ GiB") as raised:
        run_tiny(base, tmp_path / "out", progress=lambda s, f: stages.append(s))
    assert "GiB is free" in str(raised.value)
    assert set(stages) == {"merging"}
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_bigger_than_the_free_disk_is_refused_before_any_work(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    # Llama-3-8B's layer shape: few layers fill a big disk (each one is built, on meta, twice).
    hidden, intermediate = 4096, 14336
    layer_output = (4 * hidden * hidden + 3 * hidden * intermediate) * 4.5 / 8  # NVFP4 bytes per layer
    layers = int(free / layer_output * 1.2) + 1
    base = sparse_llama(tmp_path / "deep", tokenizer_dir, layers, hidden, intermediate)
    stages: list[str] = []
    with pytest.raises(PipelineError, match=r"the disk under .* has [\d.]+ GiB free, and this checkpoint needs about [\d.]+ GiB there"):
        run_tiny(base, tmp_path / "out", progress=lambda s, f: stages.append(s))
    assert set(stages) == {"merging"}


def test_a_run_leaves_no_model_behind_for_the_next_one_in_its_process(
    llama_base: Path, tmp_path: Path, calibration_file: Path
) -> None:
    # A worker runs job after job in one process. The streamed models' offload hooks make reference
    # cycles, which only the cycle collector frees: with it switched off, nothing but the run's own
    # release may free them, and a model left over would stay on the device into the next job.
    import gc

    from transformers import PreTrainedModel

    def models() -> int:  # holding memory: a shapes-only model (all on meta, kept for name mapping) holds none
        # type(), not isinstance(): the heap holds weak proxies, and isinstance asks a dead one for its class
        return sum(
            issubclass(type(o), PreTrainedModel)
            and any(t.device.type != "meta" for t in [*o.parameters(), *o.buffers()])
            for o in gc.get_objects()
        )

    gc.collect()
    before = models()
    gc.disable()
    try:
        run_tiny(llama_base, tmp_path / "out", calibration_file=calibration_file, quality_gate=False)
        left = models() - before
    finally:
        gc.enable()
    assert left == 0, f"{left} models outlived the run"


@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
def test_block_scales_are_in_memory_only_while_their_layer_is(
    make_base: Callable[..., Path], tmp_path: Path, calibration_file: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    # GPTQ against static NVFP4 scales leaves an FP32 maximum per 16 weights: an eighth of the
    # weights' BF16 bytes, which would grow with the model if every calibrated layer kept its own.
    # Whenever a layer's scales come back from disk (calibration, export), no other layer may hold
    # any; the checkpoint is byte for byte the one a run keeping them all in memory writes.
    from fp4prep.pipeline.modelopt_ext import block_scales

    base = make_base(arch)
    loads: list[int] = []
    load = block_scales.BlockScales._load

    def checked_load(self: block_scales.BlockScales, index: int, layer: torch.nn.Module) -> None:
        for other, held in enumerate(self.layers):
            if other != index and not self.open.get(other):
                amax = [q._amax for q in block_scales._block_quantizers(held).values()]
                assert all(t.is_meta for t in amax), f"layer {other} holds its scales while layer {index} loads"
        if any(q._amax.is_meta for q in block_scales._block_quantizers(layer).values()):
            loads.append(index)
        load(self, index, layer)

    monkeypatch.setattr(block_scales.BlockScales, "_load", checked_load)
    # Nor may they keep the calibrated model alive once it is exported: validation's memory is
    # the checkpoint's and the BF16 model's, a layer at a time.
    from modelopt.torch.quantization.nn import TensorQuantizer

    from fp4prep.pipeline import stages

    validate = stages.validate

    def validate_alone(*args: Any) -> Any:
        import gc

        gc.collect()
        assert not any(issubclass(type(o), TensorQuantizer) for o in gc.get_objects()), "the calibrated model outlived export"
        return validate(*args)

    monkeypatch.setattr(stages, "validate", validate_alone)
    kept_apart = run_tiny(base, tmp_path / "apart", calibration_file=calibration_file, work_dir=tmp_path / "work")
    layers = int(json.loads((base / "config.json").read_text())["num_hidden_layers"])
    assert loads == list(range(layers)), loads  # export brings each layer's back once, in order
    scales = kept_apart.reads["block_scales"]
    assert scales["passes"] == {"exporting": 1.0} and scales["size_bytes"] > 0, scales

    monkeypatch.setattr(block_scales.BlockScales, "_load", load)
    monkeypatch.setattr(block_scales.BlockScales, "_offload", lambda self, index, layer: None)
    in_memory = run_tiny(base, tmp_path / "together", calibration_file=calibration_file)
    assert in_memory.reads["block_scales"]["size_bytes"] == 0
    for path in (tmp_path / "together").glob("*.safetensors"):
        assert (tmp_path / "apart" / path.name).read_bytes() == path.read_bytes(), path.name
    assert kept_apart.reload_max_logit_diff == in_memory.reload_max_logit_diff == 0.0
