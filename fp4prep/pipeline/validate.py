"""Proving a checkpoint sound before anyone registers it.

Structure (every quantized tensor present, finite non-zero scales, the declared format written,
fused groups sharing scales, size as expected), an independent reload (``reader``), the share of
the adapter's change that survived, and token parity with the BF16 merged model. Both models may
be streamed one layer at a time: teacher-forced logits go batch by batch, and decoding runs all
prompts together so that each generated token costs one pass over the layers.
"""

from __future__ import annotations

import contextlib
import re
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .checkpoint import TensorSource, directory_bytes, read_config
from .config import ParityReport, RetentionReport
from .corpus import ParityExample
from .device import available_memory
from .errors import PipelineError
from .reader import DequantizedWeights, detect_layout
from .recipes import Recipe, Thresholds
from .weights import MergedWeights

_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def structure(directory: Path, recipe: Recipe, bf16_bytes: int) -> list[str]:
    """Checks on the files alone; raises PipelineError naming the first problem."""
    config = read_config(directory)
    layout = detect_layout(config)
    if layout.scheme != recipe.name:
        raise PipelineError(f"the checkpoint declares {layout.scheme}, the recipe is {recipe.name}")
    source = TensorSource(directory)
    names = set(source.names())
    quantized = sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale"))
    if not quantized:
        raise PipelineError("the checkpoint holds no quantized tensors")
    checks = [f"format {layout.scheme} declared and written ({len(quantized)} quantized modules)"]
    globals_: dict[str, float] = {}
    for module in quantized:
        packed = source.raw(f"{module}.{layout.packed_name}")
        scale = source.raw(f"{module}.weight_scale")
        if recipe.name in ("nvfp4", "mxfp4"):
            if packed.dtype != torch.uint8:
                raise PipelineError(f"{module}: FP4 weights stored as {packed.dtype}, not packed uint8")
            block = recipe.block_size or 1
            if scale.shape[-1] * block != packed.shape[-1] * 2:
                raise PipelineError(
                    f"{module}: {scale.shape[-1]} block scales for {packed.shape[-1] * 2} values"
                )
        elif packed.dtype != torch.float8_e4m3fn:
            raise PipelineError(f"{module}: FP8 weights stored as {packed.dtype}")
        if recipe.name == "mxfp4":
            if torch.any(scale == 255):
                raise PipelineError(f"{module}: an E8M0 scale is NaN (255)")
        elif not torch.isfinite(scale.float()).all() or torch.any(scale.float() == 0):
            raise PipelineError(f"{module}: scales must be finite and non-zero")
        if recipe.name == "nvfp4":  # always ModelOpt's layout
            for leaf in ("weight_scale_2", "input_scale"):
                key = f"{module}.{leaf}"
                if key not in names:
                    raise PipelineError(f"{module}: {leaf} is missing")
                value = float(source.raw(key).float().reshape(-1)[0])
                if not (value > 0 and value < float("inf")):
                    raise PipelineError(f"{module}: {leaf} is {value}")
            globals_[module] = float(source.raw(f"{module}.weight_scale_2").float())
    if globals_:
        checks.append(_check_fused_globals(globals_))
    excluded = _excluded(config)
    for module in quantized:
        if any(re.fullmatch(p, module) for p in excluded):
            raise PipelineError(f"{module} is quantized but listed as excluded")
    quantized_set = set(quantized)
    for name in names:
        module = name.removesuffix(".weight")
        unquantized_matrix = (
            name.endswith(".weight") and module not in quantized_set and len(source.shape(name)) == 2
        )
        if unquantized_matrix and not any(re.fullmatch(p, module) for p in excluded):
            raise PipelineError(f"{module} is left in BF16 but not listed as excluded")
    checks.append(f"every other 2-D weight is listed as excluded ({len(excluded)} patterns)")
    written = directory_bytes(directory)
    expected = _expected_bytes(source, quantized, recipe, layout.packed_name)
    if not 0.9 * expected <= written <= 1.1 * expected + (4 << 20):
        raise PipelineError(f"checkpoint is {written:,} bytes, expected about {expected:,}")
    checks.append(f"size {written:,} bytes ({written / bf16_bytes:.2f}x the BF16 merged model)")
    return checks


def _excluded(config: dict[str, Any]) -> list[str]:
    qc = config.get("quantization_config") or {}
    patterns = []
    for p in qc.get("ignore") or qc.get("exclude_modules") or []:
        patterns.append(p[3:] if p.startswith("re:") else re.escape(p).replace(r"\*", ".*"))
    return patterns


def _check_fused_globals(globals_: dict[str, float]) -> str:
    shared = 0
    for module in globals_:
        parent, _, leaf = module.rpartition(".")
        for group in _FUSED_GROUPS:
            if leaf == group[0]:
                values = {g: globals_.get(f"{parent}.{g}") for g in group}
                present = {g: v for g, v in values.items() if v is not None}
                if len(set(present.values())) > 1:
                    raise PipelineError(
                        f"{parent}: fused {'/'.join(group)} have different global scales {present}"
                    )
                shared += 1
    return f"fused groups share one global scale ({shared} groups)"


def _expected_bytes(source: TensorSource, quantized: list[str], recipe: Recipe, packed_name: str) -> int:
    total = 0
    quantized_set = set(quantized)
    for name in source.names():
        module, _, leaf = name.rpartition(".")
        shape = source.shape(name)
        numel = 1
        for d in shape:
            numel *= d
        if module in quantized_set:
            if leaf == packed_name:
                values = numel * (2 if recipe.name != "fp8" else 1)
                total += int(values * recipe.weight_bits / 8)
            elif leaf not in ("weight_scale",):
                total += 4 * numel
        else:
            total += 2 * numel
    return total


# Teacher-forced parity runs the decoder once over this many tokens at a time (one pass over a
# streamed model's layers), then applies the output head to at most LOGITS_BYTES of logits at once.
TOKENS_PER_PASS = 16384
LOGITS_BYTES = 64 << 20
# Prompts are decoded together (each decoding step is one pass over a streamed model's layers), as
# many as keep their KV cache, which grows with the model's depth, within this many bytes on a CPU
# (small models, compute-bound steps) or a tenth of the free memory of a GPU (large models, whose
# steps each read the whole model: fewer steps matter most).
KV_CACHE_BYTES = 128 << 20


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return batch_logits(model, [ids])[0]


@torch.no_grad()
def batch_logits(model: torch.nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits, [len, vocab] in float32 on the CPU; one forward for the batch."""
    ids, mask = _padded(sequences, _device(model))
    out = model(ids, attention_mask=mask, use_cache=False).logits
    return [out[row, : len(seq)].float().cpu() for row, seq in enumerate(sequences)]


def _padded(sequences: list[list[int]], device: torch.device, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        place = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, place] = torch.tensor(seq)
        mask[row, place] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def final_hidden_states(model: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's last hidden states (after the final norm), ``[len, hidden]``.

    One run of the decoder per ``TOKENS_PER_PASS`` tokens: on a streamed model that is one read of
    every layer for the whole set, where computing logits batch by batch would take one per batch.
    """
    device = _device(model)
    decoder = model.get_decoder()
    states: list[torch.Tensor] = []
    batch: list[list[int]] = []
    for i, seq in enumerate(sequences):
        batch.append(seq)
        last = i == len(sequences) - 1
        if last or (len(batch) + 1) * max(len(s) for s in [*batch, sequences[i + 1]]) > TOKENS_PER_PASS:
            ids, mask = _padded(batch, device)
            hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            states += [hidden[row, : len(s)] for row, s in enumerate(batch)]
            batch = []
    return states


@contextlib.contextmanager
def output_head(model: Any) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """The model's output head as a function of final hidden states (logits in float32, on the CPU),
    its weights held for the duration instead of read again on every call."""
    from accelerate.utils import align_module_device

    head = model.get_output_embeddings()
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise PipelineError(f"{type(model).__name__} transforms its logits after the head; parity can't chunk them")
    with align_module_device(head):
        yield lambda hidden: torch.nn.functional.linear(hidden, head.weight, head.bias).float().cpu()


def _kv_bytes_per_token(model: Any) -> int:
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # MLA models (DeepSeek) cache wider keys than head_dim says; the hidden size bounds them well.
    width = max(2 * heads * head_dim, 2 * config.hidden_size if hasattr(config, "kv_lora_rank") else 0)
    return int(config.num_hidden_layers) * width * next(model.parameters()).element_size()


def _eos_ids(model: Any) -> set[int]:
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [])


@torch.no_grad()
def greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``n`` tokens (through the first end-of-turn token).

    Prompts are decoded together, left-padded, with a KV cache: one pass over the layers per
    token for the whole batch, which is what makes decoding a streamed model affordable. The head
    is applied here, to each row's last hidden state, and held for the whole decoding.
    """
    device = _device(model)
    eos = _eos_ids(model)
    decoder = model.get_decoder()
    results: list[list[int]] = []
    per_token = _kv_bytes_per_token(model)
    budget = KV_CACHE_BYTES
    if device.type == "cuda":
        budget = max(budget, available_memory(device) // 10)
    start = 0
    with output_head(model) as head, torch.no_grad():
        while start < len(prompts):
            chunk = [prompts[start]]
            while (
                start + len(chunk) < len(prompts)
                and (len(chunk) + 1) * (max(map(len, chunk + [prompts[start + len(chunk)]])) + n) * per_token
                <= budget
            ):
                chunk.append(prompts[start + len(chunk)])
            start += len(chunk)
            ids, mask = _padded(chunk, device, left=True)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            steps = []
            for step in range(n):
                # A contiguous [batch, hidden]: a strided 3-D slice makes some CPU matmul kernels
                # expand the whole head per row (gigabytes for a large vocabulary).
                token = head(out.last_hidden_state[:, -1, :].contiguous()).argmax(-1)
                steps.append(token)
                if step == n - 1:
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                positions = positions[:, -1:] + 1
                out = decoder(
                    input_ids=token[:, None].to(device),
                    attention_mask=mask,
                    position_ids=positions,
                    cache=out.cache,
                    use_cache=True,
                )
            for row in torch.stack(steps, dim=1).tolist() if steps else [[] for _ in chunk]:
                end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                results.append(row[:end])
    return results


def reload_difference(
    reference: list[torch.Tensor], model: torch.nn.Module, examples: list[ParityExample]
) -> float:
    worst = 0.0
    for ref, example in zip(reference, examples, strict=False):
        got = logits(model, example.input_ids[: ref.shape[0]])
        worst = max(worst, float((got - ref).abs().max()))
    return worst


def token_parity(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    examples: list[ParityExample],
    continuation_tokens: int,
    report: Callable[[float], None] = lambda f: None,
) -> ParityReport:
    agree = total = 0
    kl_sum = 0.0
    sequences = [e.input_ids for e in examples]
    expected_states = final_hidden_states(reference, sequences)
    report(0.2)
    got_states = final_hidden_states(candidate, sequences)
    report(0.4)
    config: Any = reference.config
    chunk = max(1, LOGITS_BYTES // (4 * int(config.vocab_size)))
    with output_head(reference) as reference_head, output_head(candidate) as candidate_head:
        for expected_hidden, got_hidden in zip(expected_states, got_states, strict=True):
            for start in range(0, expected_hidden.shape[0], chunk):
                ref = reference_head(expected_hidden[start : start + chunk])
                got = candidate_head(got_hidden[start : start + chunk])
                agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
                total += ref.shape[0]
                kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="sum")
                kl_sum += float(kl)
    report(0.5)
    prompts = [e.prompt_ids for e in examples]
    expected = greedy(reference, prompts, continuation_tokens)
    report(0.75)
    got_continuations = greedy(candidate, prompts, continuation_tokens)
    report(1.0)
    identical = sum(a == b for a, b in zip(expected, got_continuations, strict=True))
    return ParityReport(
        prompts=len(examples),
        tokens=total,
        top1_agreement=agree / total,
        mean_kl=kl_sum / total,
        identical_greedy=identical / len(examples),
    )


def retention(merged: MergedWeights, dequantized: DequantizedWeights) -> RetentionReport | None:
    """Least-squares coefficient of (dequantized - base) on (merged - base), per changed tensor.

    About 1 when the adapter's change survived quantization, near 0 when it snapped back to the
    base (as it does when an adapter is merged into weights already in FP4). One tensor at a time.
    """
    per_tensor: dict[str, float] = {}
    num = den = 0.0
    for name in merged.targets():
        if name not in dequantized:
            continue
        b = merged.source.get(name, torch.float32, merged.device)
        delta = merged.merged(name).float() - b
        dd = float((delta * delta).sum())
        if dd == 0.0:
            continue
        change = dequantized.stored(name).to(b.device, torch.float32) - b
        dc = float((delta * change).sum())
        per_tensor[name] = dc / dd
        num += dc
        den += dd
    if not per_tensor:
        return None
    values = list(per_tensor.values())
    return RetentionReport(
        pooled=num / den, minimum=min(values), median=statistics.median(values), per_tensor=per_tensor
    )


def misses(
    thresholds: Thresholds, parity: ParityReport, reload_diff: float, kept: RetentionReport | None
) -> list[str]:
    """Every way the checkpoint falls short of its recipe's bar, as sentences."""
    failures = []
    if reload_diff > thresholds.reload_max_logit_diff:
        failures.append(
            f"the reloaded checkpoint's logits differ from the calibrated model's by {reload_diff:.3f} "
            f"(at most {thresholds.reload_max_logit_diff})"
        )
    if parity.top1_agreement < thresholds.top1_agreement:
        failures.append(f"top-1 agreement {parity.top1_agreement:.3f} < {thresholds.top1_agreement}")
    if parity.mean_kl > thresholds.mean_kl:
        failures.append(f"mean KL {parity.mean_kl:.3f} > {thresholds.mean_kl}")
    if parity.identical_greedy < thresholds.identical_greedy:
        failures.append(
            f"identical greedy share {parity.identical_greedy:.3f} < {thresholds.identical_greedy}"
        )
    if kept is not None and kept.pooled < thresholds.adapter_retention:
        failures.append(
            f"only {kept.pooled:.2f} of the adapter's change survived quantization "
            f"(at least {thresholds.adapter_retention}): was the base already quantized?"
        )
    return failures


def summary(parity: ParityReport, reload_diff: float, kept: RetentionReport | None) -> list[str]:
    return [
        f"reload matches the calibrated model (max logit difference {reload_diff:.4f})",
        f"token parity: top-1 {parity.top1_agreement:.3f}, KL {parity.mean_kl:.4f}, "
        f"identical greedy {parity.identical_greedy:.2f}",
    ] + ([f"adapter change retained: {kept.pooled:.3f} pooled"] if kept else [])


def task_success(
    model: torch.nn.Module,
    tokenizer: Any,
    eval_file: Path,
    report: Callable[[float], None] = lambda f: None,
    limit: int = 50,
) -> tuple[float, int]:
    """Share of an adapter's evaluation prompts answered exactly as expected (greedy).

    ``eval_file`` is JSONL of ``{"messages": [...], "expected": "..."}``; the answer is the
    generated text up to the end of the turn, stripped.
    """
    import json

    rows = [json.loads(line) for line in eval_file.read_text().splitlines() if line.strip()][:limit]
    if not rows:
        return 0.0, 0
    prompts, lengths = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        lengths.append(len(tokenizer(row["expected"], add_special_tokens=False)["input_ids"]) + 2)
    # Greedy decoding is prefix-consistent: each row's answer is its first ``length`` tokens.
    continuations = greedy(model, prompts, max(lengths))
    hits = 0
    for row, tokens, length in zip(rows, continuations, lengths, strict=True):
        answer = tokenizer.decode(tokens[:length], skip_special_tokens=True)
        hits += int(answer.strip() == row["expected"].strip())
    report(1.0)
    return hits / len(rows), len(rows)
