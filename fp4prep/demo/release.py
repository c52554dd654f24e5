"""FP4 releases of the demo bases, made the way releases are, to measure preparing a base that ships
only in FP4 (as Kimi-K3's release is MXFP4).

A release is the BF16 model quantized once, round to nearest with a power-of-two (E8M0) scale per 32
values, stored in compressed-tensors' ``mxfp4-pack-quantized`` layout: every linear weight of the
decoder layers for the dense demo; only the routed experts for the MoE demo (as MoE releases keep
attention, shared experts and routers in BF16, listed in the config's ignore list). Beside it, the
release dequantized back to BF16: the weights an adapter trained on the release learns on (as hosted
training does), and the base the peers' way (PEFT merge, then requantize) starts from.

    .venv/bin/python -m fp4prep.demo.release [--base dense|moe] [--task sentiment|orders|dates]

Cached beside the demo assets, in ``release-<digest of this module>/`` (``mxfp4/``, ``bf16/``,
``tasks/<task>/adapter``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fp4prep import demo
from fp4prep.demo.tasks import SENTIMENT, TASKS, Task
from fp4prep.pipeline.config import EVAL_FILE

logger = logging.getLogger(__name__)
BLOCK = 32


@dataclass
class ReleaseAssets:
    release_dir: Path  # the MXFP4 release
    dequantized_dir: Path  # the same weights in BF16, as the engine dequantizes them
    adapter_dir: Path  # trained on the dequantized release
    calibration_file: Path
    eval_file: Path


def quantized(name: str, shape: tuple[int, ...], experts_only: bool) -> bool:
    """Whether a release quantizes the stored tensor ``name``: the decoder layers' linear weights
    (the routed experts' only, for an MoE release), never what stays BF16 in every format."""
    from fp4prep.pipeline.formats import stays_bf16

    linear = len(shape) >= 2 and ".layers." in name and name.endswith(".weight") and not stays_bf16(name)
    return linear and (".experts." in name or not experts_only) and shape[-1] % BLOCK == 0


def build_release(base: Path, target: Path, experts_only: bool) -> None:
    """``base`` (a BF16 checkpoint) as an MXFP4 release in ``target``."""
    import torch

    from fp4prep.pipeline.export.compressed_tensors import scheme
    from fp4prep.pipeline.formats.numerics import e2m1_round, mxfp4_exponents, pack_e2m1
    from fp4prep.pipeline.model.safetensors import (
        Entry,
        SafetensorsFile,
        rewrite_safetensors,
        safetensors_files,
    )

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    kept: list[str] = []
    for path in safetensors_files(base):
        shard = SafetensorsFile(path)
        entries: dict[str, Entry] = {}
        for name in shard.entries:
            if not quantized(name, shard.shape(name), experts_only):
                entries[name] = name
                if len(shard.shape(name)) >= 2 and ".layers." in name and name.endswith(".weight"):
                    kept.append(name.removesuffix(".weight"))
                continue
            weight = shard.read(name).float()
            exponents = mxfp4_exponents(weight, BLOCK)
            blocks = weight.reshape(*exponents.shape, BLOCK) / torch.exp2(exponents).unsqueeze(-1)
            values = e2m1_round(blocks, ties_to_even=False).reshape(weight.shape)
            module = name.removesuffix(".weight")
            entries[f"{module}.weight_packed"] = pack_e2m1(values)
            entries[f"{module}.weight_scale"] = (exponents + 127).to(torch.uint8)
        rewrite_safetensors(shard, partial / path.name, entries)
    for path in base.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, partial / path.name)
    fmt, weights, _ = scheme("MXFP4", activations=False)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"format": fmt, "targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": sorted({_ignored(m) for m in kept} | {"lm_head"}),
    }
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def _ignored(module: str) -> str:
    """The release's ignore entry for a module it keeps in BF16: a pattern over the layers."""
    return "re:" + re.sub(r"\\\.layers\\\.\d+\\\.", r"\\.layers\\.\\d+\\.", re.escape(module)) + "$"


def dequantize(release: Path, target: Path) -> None:
    """The release's weights in BF16, as the engine dequantizes them (every value exact there)."""
    import torch
    from safetensors.torch import save_file

    from fp4prep.pipeline.model.releases import BaseSource

    source = BaseSource(release)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file({name: source.get(name, torch.bfloat16).contiguous() for name in source.names()},
              str(partial / "model.safetensors"), metadata={"format": "pt"})
    for path in release.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, partial / path.name)
    config = json.loads((release / "config.json").read_text())
    config.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def build(base: str = "dense", task: Task = SENTIMENT, force: bool = False) -> ReleaseAssets:
    """Build (or reuse) the demo base's MXFP4 release, its BF16 copy, and ``task``'s adapter trained on it."""
    assets = demo.build(task=task)  # the dense base and the calibration file
    targets: tuple[str, ...] = ()  # the expert tensors the MoE's adapter trains besides the projections
    root, base_dir, experts_only = demo.demo_dir(), assets.base_dir, False
    if base == "moe":  # the MoE base alone: its adapter is trained on the release below
        from fp4prep.demo import moe

        root, experts_only, targets = moe.moe_dir(), True, moe.EXPERT_TENSORS
        base_dir = root / "base"
        if not (base_dir / "config.json").is_file():
            moe.build_base(assets.base_dir, base_dir)
    folder = root / f"release-{_builder_digest()}"
    release, bf16, adapter = folder / "mxfp4", folder / "bf16", folder / "tasks" / task.name / "adapter"
    if force:
        for path in (release, bf16, adapter.parent):
            shutil.rmtree(path, ignore_errors=True)
    if not (release / "config.json").is_file():
        logger.info("building the %s demo's MXFP4 release in %s", base, release)
        build_release(base_dir, release, experts_only)
    if not (bf16 / "config.json").is_file():
        dequantize(release, bf16)
    if not (adapter / "adapter_model.safetensors").is_file():
        logger.info("training the %s adapter on the release in %s", task.name, adapter)
        adapter.parent.mkdir(parents=True, exist_ok=True)
        demo.train_adapter(bf16, adapter, task, target_parameters=targets)
    return ReleaseAssets(release, bf16, adapter, assets.calibration_file, adapter / EVAL_FILE)


def _builder_digest() -> str:
    """12 hex digits of this module's source: a release built by other code is built again."""
    import hashlib

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a demo base's MXFP4 release and an adapter trained on it.")
    parser.add_argument("--base", choices=["dense", "moe"], default="dense")
    parser.add_argument("--task", choices=sorted(TASKS), default=SENTIMENT.name)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    assets = build(args.base, TASKS[args.task], args.force)
    print(json.dumps({k: str(v) for k, v in vars(assets).items()}, indent=2))


if __name__ == "__main__":
    main()
