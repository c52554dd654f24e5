"""Check fp4prep against the serving engine's own code: vLLM 0.33.0, installed here, on the CPU.

One script longer than 400 lines: it runs twice, in fp4prep's environment and again inside vLLM's
(``--inside``), and both halves share its helpers.

vLLM goes into its own virtual environment (``$FP4PREP_DATA_DIR/vllm-0.33.0``, made on first use:
the vLLM wheel without its CUDA dependencies, the pure-Python packages its import needs, and this
project's torch through a path file), so nothing in fp4prep's own environment changes. Then:

    .venv/bin/python benchmarks/engine_check.py vectors [OUT.safetensors]
        vLLM's activation quantization (NVFP4 ``ref_nvfp4_quant_dequant``, per-token and static
        FP8 ``QuantFP8.forward_native``) on random tensors that reach every branch, and the NVFP4
        block scales Marlin zeroes (``nvfp4_marlin_process_scales``). The default OUT is the file
        tests/pipeline/formats/test_engine_numerics.py compares fp4prep's arithmetic with.

    .venv/bin/python benchmarks/engine_check.py demo [--base dense|moe] [--format nvfp4|mxfp4|fp8|all]
        The demo's job for each format (its recipe, quality gate off) on the dense demo or the
        Mixtral-layout MoE demo; then vLLM's own loader loads the checkpoint on the CPU (config
        discovery, the quantization config, the real model class, ``load_weights``, every layer's
        ``process_weights_after_loading``) and prints what it made of it: the quantized layers,
        their kernel or MoE backend, the tensors it placed in one of each. The checkpoint is then
        run over the job's held-back conversations with every quantized linear layer computed by
        the layer vLLM loaded (``quant_method.apply``: NVFP4 and MXFP4 on vLLM's emulation kernels,
        MXFP4 weights-only as Marlin runs it; FP8 on its CPU kernel) and every routed-experts layer
        computed from the tensors vLLM's post-processing left (its fused-MoE kernels are Triton or
        CUDA), and compared with fp4prep's reload: the agreement of the logits (top-1, KL) on the
        assistant's answers. Where a piece of vLLM runs on CUDA only, the replacement is named
        where it is made (``loaded_by_vllm``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM = "0.33.0"
# What importing vLLM's quantization utilities needs besides torch and fp4prep's own packages.
IMPORT_NEEDS = [
    "pyzmq", "cbor2", "aiohttp", "openai-harmony", "openai", "pillow", "pybase64", "cachetools",
    "msgspec", "uvloop", "prometheus_client", "xgrammar", "fastapi", "partial_json_parser",
    "llguidance", "py-cpuinfo", "blake3", "psutil", "sentencepiece", "pyyaml", "einops", "cloudpickle",
]
VECTORS = ROOT / "tests" / "pipeline" / "data" / f"vllm-{VLLM}-activations.safetensors"


def environment() -> Path:
    """The virtual environment's python, vLLM installed in it (once)."""
    data = Path(os.environ.get("FP4PREP_DATA_DIR", Path.home() / ".cache" / "fp4prep"))
    env = data / f"vllm-{VLLM}"
    python = env / "bin" / "python"
    if (env / ".ready").is_file():
        return python
    print(f"installing vLLM {VLLM} into {env} (once; ~400 MB download)", flush=True)
    venv.create(env, with_pip=True)
    site = next((env / "lib").glob("python*/site-packages"))
    ours = next((ROOT / ".venv" / "lib").glob("python*/site-packages"))
    (site / "fp4prep-venv.pth").write_text(f"{ours}\n{ROOT}\n")  # torch, transformers, fp4prep
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", f"vllm=={VLLM}"], check=True)
    subprocess.run([*pip, *IMPORT_NEEDS], check=True)
    (env / ".ready").write_text(VLLM)
    return python


def inside(argv: list[str]) -> None:
    """Re-run this script in vLLM's environment (on the CPU platform) with ``argv``."""
    environ = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    sys.exit(subprocess.run([str(environment()), __file__, "--inside", *argv], env=environ).returncode)


# --- run inside vLLM's environment ---------------------------------------------------------------


def write_vectors(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    g = torch.Generator().manual_seed(0)
    # Channels over four decades, as activations with outlier channels have: against a global
    # scale set by the outliers, the quiet blocks' E4M3 scales underflow.
    spread = torch.logspace(-4, 1, 1024)[torch.randperm(1024, generator=g)]
    # And quiet tokens (rows scaled down by up to 1e-6), whose blocks' scales round to zero.
    quiet = torch.logspace(0, -6, 96).unsqueeze(-1)
    x = (torch.randn(96, 1024, generator=g) * spread * quiet).to(torch.bfloat16)
    x[0, :16] = 0  # an all-zero block
    x[1, :64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8)  # E2M1 ties at scale 1
    tensors = {"x": x}
    amax = x.float().abs().amax()
    # The global amax of calibration (above, at and well below the tensor's own), as ModelOpt's
    # export stores it: input_scale = amax / (6 * 448); vLLM's global scale is its reciprocal.
    for i, factor in enumerate((4.0, 1.0, 0.3, 0.01)):
        calibrated = (amax * factor).reshape(1)
        input_scale = calibrated / 2688.0
        global_scale = (1.0 / input_scale.max().to(torch.float32)).to(torch.float32)
        tensors[f"nvfp4.{i}.amax"] = calibrated
        tensors[f"nvfp4.{i}.global_scale"] = global_scale.reshape(1)
        tensors[f"nvfp4.{i}.out"] = ref_nvfp4_quant_dequant(x, global_scale, 16)
    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        static = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    q, scale = quant.forward_native(x)
    tensors["fp8.out"] = (q.float() * scale).to(x.dtype)
    # Static per-tensor inputs (routed experts' FP8): a stored scale under the tensor's own amax/448,
    # so some values clip.
    tensors["fp8.static.scale"] = (amax / 448.0 * 0.5).to(torch.float32).reshape(())
    q, scale = static.forward_native(x, tensors["fp8.static.scale"])
    tensors["fp8.static.out"] = (q.float() * scale).to(x.dtype)
    # Marlin's NVFP4 block scales (W4A16 below Blackwell): which it zeroes, for layers whose largest
    # scale is at, a little and far under 448 (its power-of-two factor then differs).
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import nvfp4_marlin_process_scales

    for i, top in enumerate((448.0, 100.0, 3.0)):
        scales = (torch.rand(64, 64, generator=g) ** 6 * top).to(torch.float8_e4m3fn)
        scales[0, 0] = torch.tensor(top).to(torch.float8_e4m3fn)
        processed, factor = nvfp4_marlin_process_scales(scales.to(torch.bfloat16), a_dtype=torch.bfloat16)
        kept = (processed.view(torch.uint8) != 0).reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(scales.shape)  # its [0,2,1,3] undone
        tensors[f"marlin.{i}.scales"], tensors[f"marlin.{i}.factor"] = scales, torch.tensor(float(factor))
        tensors[f"marlin.{i}.kept"] = kept
    # A dense FP8 layer's product as vLLM's CPU kernel computes it (``ChannelWiseTorchFP8ScaledMMLinearKernel``:
    # ``torch._scaled_mm`` of the codes, then the token and channel scales), on weights whose rows'
    # magnitudes span three decades.
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel

    w = torch.randn(256, 1024, generator=g) * torch.logspace(-3, 0, 256).unsqueeze(-1)
    w_scale = (w.abs().amax(dim=-1, keepdim=True) / 448.0).to(torch.float32)
    tensors["fp8.linear.weight"] = (w / w_scale).to(torch.float8_e4m3fn)
    tensors["fp8.linear.weight_scale"] = w_scale.reshape(-1)
    q, scale = quant.forward_native(x)
    tensors["fp8.linear.out"] = ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm(
        None, A=q, B=tensors["fp8.linear.weight"].t(), out_dtype=x.dtype, As=scale, Bs=w_scale, bias=None,  # type: ignore[arg-type]
        output_shape=[x.shape[0], w.shape[0]],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata={"vllm": VLLM})
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB): vLLM {VLLM}'s outputs on {tuple(x.shape)} BF16 inputs")


def emulated(directory: Path, compute: object) -> object:
    """The checkpoint with every quantized linear layer computed by vLLM's emulation functions (FP8: its
    kernels' arithmetic, with its input quantization)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import run_nvfp4_emulations
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from fp4prep.pipeline.model.safetensors import TensorSource
    from fp4prep.pipeline.validation import reader

    source = TensorSource(directory)
    stored = set(source.names())
    model = reader.load(directory, compute, quantize_activations=False)  # type: ignore[arg-type]
    with set_current_vllm_config(VllmConfig()):
        fp8_input = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
    read: dict[str, int] = {}

    def nvfp4(name: str, x: torch.Tensor) -> torch.Tensor:
        raw = {leaf: source.raw(f"{name}.{leaf}") for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
        # ModelOptNvFp4 post-processing: the global scales' maxima, the input's as a reciprocal.
        weight_global = raw["weight_scale_2"].max().to(torch.float32)
        input_global_inv = (1.0 / raw["input_scale"].max().to(torch.float32)).to(torch.float32)
        flat = x.reshape(-1, x.shape[-1])
        out = run_nvfp4_emulations(flat, input_global_inv, raw["weight"], raw["weight_scale"], weight_global, swizzle=False)
        return out.reshape(*x.shape[:-1], -1)

    def fp8(name: str, x: torch.Tensor) -> torch.Tensor:
        # vLLM's FP8 kernels: the codes multiplied, then the token and channel scales.
        weight, scale = source.raw(f"{name}.weight"), source.raw(f"{name}.weight_scale").float()
        q, q_scale = fp8_input.forward_native(x.reshape(-1, x.shape[-1]))
        out = (q.float() @ weight.float().T) * q_scale * scale.reshape(1, -1)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or f"{name}.weight_scale" not in stored:
            continue
        kind = "nvfp4" if f"{name}.weight_scale_2" in stored else "fp8"
        read[kind] = read.get(kind, 0) + 1
        compute_layer = nvfp4 if kind == "nvfp4" else fp8
        module.forward = lambda x, n=name, f=compute_layer: f(n, x)  # type: ignore[method-assign]
    print("vLLM computes " + ", ".join(f"{n} {kind} linear layers" for kind, n in sorted(read.items())))
    return model


def _moe_experts() -> list[type]:
    """vLLM's routed-experts classes this check lets run their post-processing on a CPU: Triton's
    (FP8 with static per-tensor scales, as on Hopper), the emulation ones for NVFP4 and MXFP4 (what
    vLLM runs where no FP4 MoE kernel does) and Marlin's (MXFP4 below Blackwell). All of them
    compute with Triton or CUDA kernels."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.experts.ocp_mx_emulation_moe import (
        OCP_MXQuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    return [TritonExperts, Nvfp4QuantizationEmulationTritonExperts, OCP_MXQuantizationEmulationTritonExperts, MarlinExperts]


def _dequant_mxfp4(x: object, scale: object, dtype: object) -> object:
    """``dequant_mxfp4`` without AMD's quark (whose kernel runs on CUDA only): vLLM's own E2M1
    nibble decoding (``break_fp4_bytes``, low nibble first) times each block's E8M0 power of two,
    exact in BF16 as Marlin's weights-only dequantization is."""
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    packed = x.reshape(-1, x.shape[-1])  # type: ignore[attr-defined]
    values = break_fp4_bytes(packed, torch.float32).reshape(*x.shape[:-1], -1)  # type: ignore[attr-defined]
    powers = torch.exp2(scale.to(torch.float32) - 127.0)  # type: ignore[attr-defined]
    blocks = values.reshape(*values.shape[:-1], powers.shape[-1], -1) * powers.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)


def _scaled_fp8_quant(x: object, scale: object = None, *args: object, **kwargs: object) -> object:
    """``vllm._custom_ops.scaled_fp8_quant`` per tensor, computed by vLLM's ``QuantFP8.forward_native``
    (its CUDA op has no CPU build; the FP8 MoE post-processing calls it to requantize gate and up)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=scale is not None, group_shape=GroupShape.PER_TENSOR)
    return quant.forward_native(x, scale)


def loaded_by_vllm(directory: Path, moe_backend: str = "auto") -> object:
    """The checkpoint as vLLM's own loader makes it, on the CPU: its config discovery and quantization
    config, the real model class, ``load_weights`` and every layer's ``process_weights_after_loading``.
    vLLM lists no NVFP4 kernel for the CPU platform; its emulation kernel (what it falls back to
    where no optimized one runs) is put in that list, and FP8 takes vLLM's own choice. The loader's
    call that empties the GPU allocator's cache is skipped: there is none."""
    import torch
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.kernels.linear.mxfp4.emulation as mxfp4_emulation
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4 as mxfp4_moe
    from vllm import _custom_ops as ops
    from vllm.config import (
        DeviceConfig,
        KernelConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    kernels._POSSIBLE_NVFP4_KERNELS[current_platform._enum] = [kernels.EmulationNvFp4LinearKernel]
    kernels._POSSIBLE_MXFP4_KERNELS[current_platform._enum] = [mxfp4_emulation.EmulationMxfp4LinearKernel]
    torch.accelerator.empty_cache = lambda: None  # the loader frees its allocator's cache; a CPU has none
    ops.scaled_fp8_quant = _scaled_fp8_quant  # its CUDA op, in vLLM's own native arithmetic
    mxfp4_emulation.has_quark, mxfp4_emulation.dequant_mxfp4 = (lambda: True), _dequant_mxfp4
    # vLLM reads MXFP4 linear layers as W4A4; below Blackwell Marlin runs them weights-only, the
    # numerics fp4prep declares and measures: the emulation kernel with its input QDQ left out.
    functions = mxfp4_emulation._ACTIVATION_QUANT_DEQUANT_FUNCS
    functions.update({key: (lambda x: x) for key in functions})
    # MXFP4 routed experts go to Marlin below Blackwell; its repacking is a CUDA op: the experts are
    # computed from the tensors as loaded instead (``expert_arithmetic``), weights only as Marlin's.
    mxfp4_moe.prepare_moe_fp4_layer_for_marlin = lambda layer: None
    # The routed experts' backend a GPU would take (below), its post-processing run here: its
    # kernels are Triton's, for CUDA, and the experts are computed from the tensors it leaves.
    for experts in _moe_experts():
        experts._supports_current_device = staticmethod(lambda: True)
    current_platform.supports_fp8 = lambda: True  # as a GPU that runs FP8 MoE (Hopper, Blackwell)
    model_config = ModelConfig(model=str(directory), dtype="bfloat16", enforce_eager=True)
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig(device="cpu"),
                        kernel_config=KernelConfig(moe_backend=moe_backend))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{directory}/.vllm-init"
        )
        initialize_model_parallel(1, 1)
        model = get_model_loader(config.load_config).load_model(vllm_config=config, model_config=model_config)
    quantized: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "kernel", None) or getattr(getattr(module, "scheme", None), "kernel", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            label = f"{type(method).__name__} ({type(kernel).__name__ if kernel is not None else 'its own apply'})"
            quantized.setdefault(label, []).append(name)
    print(f"vLLM {VLLM} loaded {model_config.architecture} with quantization {model_config.quantization!r}: "
          + "; ".join(f"{len(names)} layers by {label}" for label, names in quantized.items()), flush=True)
    first = next(names[0] for label, names in quantized.items() if "LinearMethod" in label)
    placed = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters() if n.startswith(first + ".")}
    print(f"placed in {first}: " + ", ".join(f"{n.rpartition('.')[2]} {shape} {dtype}" for n, (shape, dtype) in placed.items()))
    experts = next((n for n, m in model.named_modules() if n.endswith("routed_experts")), None)
    if experts is not None:
        method = dict(model.named_modules())[experts].quant_method
        backend = next((str(v).rpartition(".")[2] for k, v in vars(method).items() if k.endswith("backend")), "?")
        placed = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters() if n.startswith(experts + ".")}
        print(f"placed in {experts} ({type(method).__name__}, backend {backend}): "
              + ", ".join(f"{n.rpartition('.')[2]} {shape} {dtype}" for n, (shape, dtype) in placed.items()))
    model.vllm_config = config  # type: ignore[attr-defined]
    return model


def vllm_computed(directory: Path, compute: object, moe_backend: str = "auto") -> object:
    """The checkpoint with every quantized linear layer computed by the layer vLLM's loader made
    (``quant_method.apply``: its kernel on the tensors as its post-processing left them); q/k/v and
    gate/up are one fused layer there, computed once per input and split."""
    import torch
    from vllm.config import set_current_vllm_config

    from fp4prep.pipeline.validation import reader

    theirs = loaded_by_vllm(directory, moe_backend)
    modules = dict(theirs.named_modules())  # type: ignore[attr-defined]
    ours = reader.load(directory, compute, quantize_activations=False)  # type: ignore[arg-type]
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(layer_name: str, part: int | None, x: torch.Tensor) -> torch.Tensor:
        layer = modules[layer_name]
        cached = last.get(layer_name)
        if cached is None or cached[0] is not x:
            with set_current_vllm_config(theirs.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
                flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
                out = layer.quant_method.apply(layer, flat, None).to(x.dtype)
            last[layer_name] = cached = (x, out)
        out = cached[1]
        if part is not None:
            sizes = list(layer.output_sizes)
            start = sum(sizes[:part])
            out = out[:, start : start + sizes[part]]
        return out.reshape(*x.shape[:-1], -1)

    routed = {_layer_of(n): m for n, m in modules.items() if n.endswith("routed_experts")}
    for name, module in ours.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and _layer_of(name) in routed:
            module.forward = routed_experts(routed[_layer_of(name)], module.act_fn)  # type: ignore[method-assign]
            continue
        if not isinstance(module, torch.nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        target, part = (f"{parent}.{packed[leaf][0]}", packed[leaf][1]) if leaf in packed else (name, None)
        layer = modules.get(target)
        if layer is None or type(layer.quant_method).__name__ == "UnquantizedLinearMethod":
            continue
        module.forward = lambda x, t=target, p=part: run(t, p, x)  # type: ignore[method-assign]
    return ours


def _layer_of(name: str) -> int:
    import re

    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def expert_arithmetic(layer: object) -> tuple[object, object, object, object, str]:
    """What a routed-experts layer vLLM loaded computes, from the tensors its post-processing left
    (its kernels are Triton's, for CUDA): each expert's gate/up and down weights dequantized, and the
    quantization of their inputs, with vLLM's own functions. Returns (w13, w2, inputs13, inputs2, how)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
        ref_nvfp4_quant_dequant,
    )

    method = type(layer.quant_method).__name__  # type: ignore[attr-defined]
    t = dict(layer.named_parameters())  # type: ignore[attr-defined]
    if "NvFp4" in method:
        w13 = dequantize_to_dtype(t["w13_weight"], t["w13_weight_scale"], t["w13_weight_scale_2"], torch.float32, 16, swizzle=False)
        w2 = dequantize_to_dtype(t["w2_weight"], t["w2_weight_scale"], t["w2_weight_scale_2"], torch.float32, 16, swizzle=False)
        a13, a2 = t["w13_input_scale"].float(), t["w2_input_scale"].float()
        return w13, w2, (lambda x: ref_nvfp4_quant_dequant(x, a13, 16)), (lambda x: ref_nvfp4_quant_dequant(x, a2, 16)), \
            "dequantize_to_dtype on the weights, ref_nvfp4_quant_dequant on the inputs (the layer's max input scale)"
    if "Mxfp4" in method:
        w13 = _dequant_mxfp4(t["w13_weight"], t["w13_weight_scale"], torch.float32)
        w2 = _dequant_mxfp4(t["w2_weight"], t["w2_weight_scale"], torch.float32)
        return w13, w2, (lambda x: x), (lambda x: x), \
            "E2M1 weights times their E8M0 block scales as loaded (before Marlin's CUDA repacking), BF16 inputs (W4A16)"
    raise SystemExit(f"no arithmetic here for vLLM's {method}")


_TOLD: set[str] = set()


def triton_fp8_experts(layer: object, act_fn: object) -> object:
    """A transformers experts forward computing FP8 routed experts as vLLM's Triton fused-MoE kernel
    does (``fused_moe.py``, ``fused_moe_kernel``) from the tensors its post-processing left: the
    input quantized with the layer's one static scale (``QuantFP8``, as ``scaled_fp8_quant``), the
    E4M3 codes multiplied with FP32 sums, then ``accumulator * a_scale * b_scale``, in the second
    product times the routing weight, and one rounding to BF16; the activation between the two on
    BF16, as vLLM's CPU ``SiluAndMul.forward_native`` (its CUDA kernel computes it in FP32)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    t = dict(layer.named_parameters())  # type: ignore[attr-defined]

    def product(x: torch.Tensor, name: str, e: int, routing: torch.Tensor | None = None) -> torch.Tensor:
        q, a_scale = quant.forward_native(x, t[f"{name}_input_scale"])
        accumulator = (q.float() @ t[f"{name}_weight"][e].float().T) * a_scale * t[f"{name}_weight_scale"][e].float()
        if routing is not None:
            accumulator = accumulator * routing.float()[:, None]
        return accumulator.to(torch.bfloat16)

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(t["w13_weight"].shape[0]):
            slot, rows = torch.where((top_k_index == e).T)
            if rows.numel() == 0:
                continue
            gate, up = product(hidden[rows].to(torch.bfloat16), "w13", e).chunk(2, dim=-1)
            y = product(act_fn(gate) * up, "w2", e, top_k_weights[rows, slot])  # type: ignore[operator]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    return forward


def routed_experts(layer: object, act_fn: object) -> object:
    """A transformers experts forward computing each expert as vLLM's layer does (``expert_arithmetic``)."""
    import torch
    import torch.nn.functional as F

    if "Fp8" in type(layer.quant_method).__name__:  # type: ignore[attr-defined]
        how = "the Triton kernel's arithmetic: E4M3 codes multiplied, the scales and routing weight applied to the FP32 sums"
        if how not in _TOLD:
            _TOLD.add(how)
            print(f"routed experts computed from vLLM's {type(layer.quant_method).__name__} tensors: {how}", flush=True)  # type: ignore[attr-defined]
        return triton_fp8_experts(layer, act_fn)
    w13, w2, in13, in2, how = expert_arithmetic(layer)
    if how not in _TOLD:
        _TOLD.add(how)
        print(f"routed experts computed from vLLM's {type(layer.quant_method).__name__} tensors: {how}", flush=True)  # type: ignore[attr-defined]

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(w13.shape[0]):  # type: ignore[attr-defined]
            slot, rows = torch.where((top_k_index == e).T)
            if rows.numel() == 0:
                continue
            x = in13(hidden[rows].to(torch.bfloat16))  # type: ignore[operator]
            gate, up = F.linear(x, w13[e].to(x.dtype)).chunk(2, dim=-1)  # type: ignore[index]
            h = in2((act_fn(gate) * up).to(torch.bfloat16))  # type: ignore[operator]
            y = F.linear(h, w2[e].to(h.dtype)) * top_k_weights[rows, slot, None]  # type: ignore[index]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    return forward


def modelopt_arithmetic(directory: Path, compute: object) -> object:
    """fp4prep's reload as it was before it followed the engine: the inputs quantized with
    ModelOpt's arithmetic (the weights' own), from the same stored scales."""
    from functools import partial

    from fp4prep.pipeline.formats import numerics
    from fp4prep.pipeline.model.safetensors import TensorSource
    from fp4prep.pipeline.validation import reader

    source = TensorSource(directory)
    stored = set(source.names())
    model = reader.load(directory, compute, quantize_activations=False)  # type: ignore[arg-type]
    for name, module in model.named_modules():
        if f"{name}.input_scale" in stored:
            amax = source.raw(f"{name}.input_scale").float() * numerics.NVFP4_GLOBAL
            quantize = partial(numerics.nvfp4_fake_quant, block_size=16, global_amax=amax)
        elif f"{name}.weight_scale" in stored:
            quantize = lambda x: numerics.fp8_fake_quant(x, x.abs().amax(-1, keepdim=True))  # noqa: E731
        else:
            continue
        module.register_forward_pre_hook(lambda m, args, q=quantize: (q(args[0]), *args[1:]))
    return model


def compare(directory: Path, examples_file: Path, moe_backend: str = "auto") -> None:
    import json

    import torch

    from fp4prep.pipeline import device
    from fp4prep.pipeline.validation import parity, reader

    compute = device.resolve("cpu")
    examples = json.loads(examples_file.read_text())
    sequences = [e["input_ids"] for e in examples]
    vllm = vllm_computed(directory, compute, moe_backend)
    candidates = {"fp4prep's reload": reader.load(directory, compute)}
    config = json.loads((directory / "config.json").read_text())
    moe = any(k in config for k in ("num_local_experts", "n_routed_experts", "num_experts"))
    if config["quantization_config"].get("quant_method") == "modelopt" and not moe:  # the dense checks of before
        candidates["vLLM's emulation functions on the stored tensors"] = emulated(directory, compute)
        candidates["ModelOpt's arithmetic for the inputs"] = modelopt_arithmetic(directory, compute)
    with torch.no_grad():
        reference = parity.final_hidden_states(vllm, sequences)
        for label, model in candidates.items():
            tally, worst = parity._Tally(), 0.0
            states = parity.final_hidden_states(model, sequences)
            with parity.output_head(vllm) as their_head, parity.output_head(model) as our_head:
                for e, a, b in zip(examples, states, reference, strict=True):
                    rows = parity._positions(len(e["input_ids"]), [tuple(s) for s in e["answer_spans"]])
                    ref, got = their_head(b[rows]), our_head(a[rows])
                    tally.add(ref, got)
                    worst = max(worst, float((ref - got).abs().max()))
            print(json.dumps({"against vLLM's loaded layers": label, "compute": str(compute.dtype),
                              "answer_tokens": tally.tokens, "top1_agreement": round(tally.top1, 4),
                              "mean_kl": round(tally.mean_kl, 5), "max_logit_difference": round(worst, 4)}), flush=True)


# The routed experts' backend asked of vLLM per format (``KernelConfig.moe_backend``): FP8 as on
# Hopper (Triton, static per-tensor scales), NVFP4 on vLLM's emulation (what it runs where no FP4 MoE
# kernel does), MXFP4 by vLLM's own choice below Blackwell (Marlin, weights only).
MOE_BACKENDS = {"fp8": "triton", "nvfp4": "emulation", "mxfp4": "auto"}


def demo(formats: list[str], base: str) -> None:
    import json
    import tempfile
    from dataclasses import asdict

    from fp4prep import demo as demo_assets
    from fp4prep.demo import moe
    from fp4prep.pipeline import PipelineConfig, run
    from fp4prep.pipeline.stages import _corpus, _tokenizer

    assets = moe.build() if base == "moe" else demo_assets.build()
    for fmt in formats:
        with tempfile.TemporaryDirectory(prefix="fp4prep-engine-") as tmp:
            config = PipelineConfig(output_dir=Path(tmp) / "out", base_dir=assets.base_dir, adapter_dir=assets.adapter_dir,
                                    calibration_file=assets.calibration_file, quantization=fmt, quality_gate=False,
                                    parity_prompts=60)
            result = run(config)
            examples = _corpus(config, _tokenizer(config.base_dir)).parity
            examples_file = Path(tmp) / "examples.json"
            examples_file.write_text(json.dumps([asdict(e) for e in examples]))
            print(f"{fmt}: the job's parity with BF16 on answers: top-1 {result.parity.answer_top1:.4f}, "
                  f"KL {result.parity.answer_kl:.4f}", flush=True)
            environ = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
            subprocess.run([str(environment()), __file__, "--inside", "compare", str(result.output_dir), str(examples_file),
                            "--moe-backend", MOE_BACKENDS[fmt]], env=environ, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    vec = sub.add_parser("vectors")
    vec.add_argument("out", nargs="?", type=Path, default=VECTORS)
    dm = sub.add_parser("demo")
    dm.add_argument("--format", choices=["nvfp4", "mxfp4", "fp8", "all"], default="all")
    dm.add_argument("--base", choices=["dense", "moe"], default="dense", help="the dense demo or the MoE demo (Mixtral layout)")
    cmp = sub.add_parser("compare", help=argparse.SUPPRESS)
    cmp.add_argument("directory", type=Path)
    cmp.add_argument("examples", type=Path)
    cmp.add_argument("--moe-backend", default="auto")
    args = parser.parse_args()
    if args.command == "demo":
        demo(["nvfp4", "mxfp4", "fp8"] if args.format == "all" else [args.format], args.base)
    elif not args.inside:
        inside(sys.argv[1:])
    elif args.command == "vectors":
        write_vectors(args.out)
    else:
        compare(args.directory, args.examples, args.moe_backend)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
