"""Behaviour against the BF16 merged model: what the checkpoint says, and where the model answers.

Parity is measured over held-back conversations, teacher-forced: over every token (most of which
are the user's text, where any two models differ), over the assistant turns only, and over the
BF16 model's own greedy continuations of each prompt (does the checkpoint pick the token the BF16
model picked, on the BF16 model's path, and the share of prompts where it picks every one of them:
the share whose greedy continuation would come out identical). Every model runs its decoder once
over all sequences (on a streamed model, one read of each layer) and the head is applied in chunks.
The BF16 model's continuations are found the same way: each prompt is run with a guess at its
continuation (the held-back answer), and the guess is kept as far as the model's own picks confirm
it; a prompt whose guess falls short runs again from the model's corrected picks, so a streamed
model is read once more per round of corrections, not once per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ParityReport
from ..device import available_memory
from ..errors import PipelineError
from ..inputs.corpus import ParityExample
from . import continuations
from .prompt_cache import PromptCache, Runs
from .task import TaskSet

# Teacher-forced parity runs the decoder once over this many tokens at a time (one pass over a
# streamed model's layers), then applies the output head to at most LOGITS_BYTES of logits at once.
TOKENS_PER_PASS = 16384
LOGITS_BYTES = 64 << 20
# Prompts are decoded together (each decoding step is one pass over a streamed model's layers), as
# many as keep their KV cache, which grows with the model's depth, within a tenth of the device's
# free memory and at least this many bytes: every further batch of prompts decodes all its tokens
# again, one more pass over the layers per token. Checking guesses keeps the prompts' keys and
# values within the same budget, or runs the prompts again each round.
KV_CACHE_BYTES = 128 << 20


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _kv_budget(model: Any) -> int:
    return max(KV_CACHE_BYTES, available_memory(_device(model)) // 10)


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
def final_hidden_states(model: Any, sequences: list[list[int]], cache: PromptCache | None = None) -> list[torch.Tensor]:
    """Each sequence's last hidden states (after the final norm), ``[len, hidden]``.

    One run of the decoder per ``TOKENS_PER_PASS`` tokens: on a streamed model that is one read of
    every layer for the whole set, where computing logits batch by batch would take one per batch.
    Sequences are batched shortest first, so that little of a pass is padding. With ``cache``, the
    keys and values of the prompts it keeps are kept too.
    """
    device = _device(model)
    decoder = model.get_decoder()
    states: list[torch.Tensor | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batch: list[int] = []
    for k, i in enumerate(order):
        batch.append(i)
        last = k == len(order) - 1
        # Sorted: the next sequence is the longest the batch would hold.
        if last or (len(batch) + 1) * len(sequences[order[k + 1]]) > TOKENS_PER_PASS:
            ids, mask = _padded([sequences[j] for j in batch], device)
            if cache is not None:
                cache.recording(batch, device)
            hidden = decoder(
                input_ids=ids, attention_mask=mask, cache=cache, use_cache=cache is not None
            ).last_hidden_state
            for row, j in enumerate(batch):
                states[j] = hidden[row, : len(sequences[j])]
            batch = []
    assert all(s is not None for s in states)
    return states  # type: ignore[return-value]


def prefix_states(model: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """``final_hidden_states`` of each sequence, those that start a longer one (a prompt and the
    held-back answer the BF16 model gave again, within its conversation) read off that one's run:
    states depend only on the tokens before them."""
    owner = [
        min(range(len(sequences)), key=lambda j: (sequences[j][: len(s)] != s, -len(sequences[j]), j))
        for s in sequences
    ]
    run = sorted(set(owner))
    states = dict(zip(run, final_hidden_states(model, [sequences[j] for j in run]), strict=True))
    return [states[j][: len(s)] for j, s in zip(owner, sequences, strict=True)]


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


def end_of_turn(model: Any) -> set[int]:
    """The tokens that end the model's turn (its generation config's end-of-sequence IDs)."""
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [])


@torch.no_grad()
def greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``n`` tokens (through the first end-of-turn token).

    Prompts are decoded together, left-padded, with a KV cache: one pass over the layers per
    token for the whole batch; decoding stops once every prompt has ended its turn. The head is
    applied here, to each row's last hidden state, and held for the whole decoding. Validation
    finds the BF16 model's continuations with ``verified_greedy`` (fewer passes); this is the plain
    decoding the benchmarks and tests hold it and the teacher-forced figures to.
    """
    device = _device(model)
    eos = end_of_turn(model)
    decoder = model.get_decoder()
    results: list[list[int]] = []
    per_token = _kv_bytes_per_token(model)
    budget = _kv_budget(model)
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
            ended = torch.zeros(len(chunk), dtype=torch.bool)
            stops = torch.tensor(sorted(eos), dtype=torch.long)
            for step in range(n):
                # A contiguous [batch, hidden]: a strided 3-D slice makes some CPU matmul kernels
                # expand the whole head per row (gigabytes for a large vocabulary).
                token = head(out.last_hidden_state[:, -1, :].contiguous()).argmax(-1)
                steps.append(token)
                ended |= torch.isin(token.cpu(), stops)
                # Every row has ended its turn: what follows would be cut off anyway.
                if step == n - 1 or bool(ended.all()):
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


def reload_difference(reference: torch.Tensor, model: torch.nn.Module, ids: list[int]) -> float:
    """The largest difference between ``model``'s logits on the first tokens of ``ids`` and
    ``reference`` (the calibrated model's on as many)."""
    return float((logits(model, ids[: reference.shape[0]]) - reference).abs().max())


@dataclass
class _Tally:
    agree: int = 0
    tokens: int = 0
    kl: float = 0.0

    def add(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        self.agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        self.tokens += ref.shape[0]
        self.kl += float(F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="sum"))

    @property
    def top1(self) -> float:
        return self.agree / self.tokens if self.tokens else 0.0

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens if self.tokens else 0.0


def _positions(length: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The positions whose next-token distribution predicts a token inside ``spans``."""
    rows = [p - 1 for start, end in spans for p in range(max(start, 1), min(end, length))]
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class Reference:
    """The BF16 model's side of parity, computed once for every candidate measured against it: its
    greedy continuations of the held-back prompts, its final hidden states over the whole
    conversations, over those continuations and over the adapter's task, and its task score."""

    model: Any
    examples: list[ParityExample]
    continuation_tokens: int
    expected: list[list[int]]
    states: list[torch.Tensor]
    task: TaskSet | None = None
    task_success: float = 0.0

    @property
    def prompts(self) -> list[list[int]]:
        return [e.prompt_ids for e in self.examples]

    @property
    def sequences(self) -> list[list[int]]:
        """What each model's decoder runs over, teacher-forced, once: the held-back conversations,
        the prompts with the BF16 model's continuations, the task's prompts with their answers."""
        continued = [p + c for p, c in zip(self.prompts, self.expected, strict=True)]
        return [e.input_ids for e in self.examples] + continued + (self.task.sequences if self.task else [])


def reference_of(
    model: Any,
    examples: list[ParityExample],
    continuation_tokens: int,
    report: Callable[[float], None] = lambda f: None,
    task: TaskSet | None = None,
) -> Reference:
    """The BF16 model's greedy continuations of the held-back prompts and its final hidden states
    over everything candidates are compared on, in as few runs of the decoder as ``verified_greedy``
    needs: the conversations and the task's answers run with its first round."""
    fixed = [e.input_ids for e in examples] + (task.sequences if task else [])
    prompts, drafts = [e.prompt_ids for e in examples], [continuations.draft(e) for e in examples]
    found = verified_greedy(model, prompts, drafts, continuation_tokens, fixed, lambda f: report(0.9 * f))
    n = len(examples)
    states = found.alongside[:n] + found.states + found.alongside[n:]
    ref = Reference(model, examples, continuation_tokens, found.tokens, states, task)
    if task is not None:
        with output_head(model) as head:
            ref.task_success = task.success(ref.states[2 * n :], head)
    report(1.0)
    return ref


def verified_greedy(
    model: Any,
    prompts: list[list[int]],
    drafts: list[list[int]],
    n: int,
    alongside: list[list[int]] | None = None,
    report: Callable[[float], None] = lambda f: None,
) -> continuations.Verified:
    """``continuations.verified_greedy`` on ``model``, run and read as everything here is."""
    runs = Runs(model, final_hidden_states, _kv_bytes_per_token(model), _kv_budget(model))
    return continuations.verified_greedy(
        model, prompts, drafts, n, alongside, report, runs=runs, head_of=output_head, eos=end_of_turn(model)
    )


def token_parity(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    examples: list[ParityExample],
    continuation_tokens: int,
    report: Callable[[float], None] = lambda f: None,
) -> ParityReport:
    ref = reference_of(reference, examples, continuation_tokens, lambda f: report(0.8 * f))
    return compare(ref, candidate, lambda f: report(0.8 + 0.2 * f)).parity


@dataclass
class Behaviour:
    """A candidate against the BF16 model: parity, and its score on the adapter's task (None
    without one)."""

    parity: ParityReport
    task_success: float | None


def compare(ref: Reference, candidate: Any, report: Callable[[float], None] = lambda f: None) -> Behaviour:
    """``candidate`` against the BF16 model's ``ref``, all teacher-forced in one run of the
    candidate's decoder: over whole conversations, their answers and the BF16 model's continuations,
    and on the adapter's task.

    A candidate's greedy continuation is identical to the BF16 model's exactly when, fed that
    continuation, it picks each of its tokens in turn: so the identical share needs no decoding.
    """
    examples, prompts, expected = ref.examples, ref.prompts, ref.expected
    got_states = prefix_states(candidate, ref.sequences)
    report(0.8)
    ref_states = ref.states
    n = len(examples)
    # Per sequence, the positions each tally reads: an assistant turn's are among its conversation's,
    # so the heads run once per position whatever reads it.
    wanted: dict[int, dict[str, torch.Tensor]] = {}
    for i, e in enumerate(examples):
        length = len(e.input_ids)
        wanted[i] = {"whole": torch.arange(length - 1), "answers": _positions(length, e.answer_spans)}
    for i, (prompt, tokens) in enumerate(zip(prompts, expected, strict=True)):
        wanted[n + i] = {"continuations": _positions(len(prompt) + len(tokens), [(len(prompt), len(prompt) + len(tokens))])}
    tallies = {name: _Tally() for name in ("whole", "answers", "continuations")}
    chosen: dict[int, list[int]] = {}  # the candidate's top token on each continuation, in order
    config: Any = ref.model.config
    chunk = max(1, LOGITS_BYTES // (4 * int(config.vocab_size)))
    with output_head(ref.model) as reference_head, output_head(candidate) as candidate_head:
        for index, reads in wanted.items():
            rows = torch.unique(torch.cat(list(reads.values())))  # sorted, as each tally's are
            for start in range(0, len(rows), chunk):
                part = rows[start : start + chunk]
                got_ref = reference_head(ref_states[index][part.to(ref_states[index].device)])
                got = candidate_head(got_states[index][part.to(got_states[index].device)])
                for name, positions in reads.items():
                    pick = torch.isin(part, positions)
                    if not bool(pick.any()):
                        continue
                    tallies[name].add(got_ref[pick], got[pick])
                    if name == "continuations":
                        chosen.setdefault(index, []).extend(got[pick].argmax(-1).tolist())
        task = ref.task.success(got_states[2 * n :], candidate_head) if ref.task is not None else None
    report(1.0)
    identical = sum(chosen.get(n + i, []) == tokens for i, tokens in enumerate(expected))
    whole, answers, continuations = tallies["whole"], tallies["answers"], tallies["continuations"]
    parity = ParityReport(
        prompts=n,
        tokens=whole.tokens,
        top1_agreement=whole.top1,
        mean_kl=whole.mean_kl,
        identical_greedy=identical / n,
        answer_tokens=answers.tokens,
        answer_top1=answers.top1,
        answer_kl=answers.mean_kl,
        continuation_tokens=continuations.tokens,
        continuation_top1=continuations.top1,
        continuation_kl=continuations.mean_kl,
    )
    return Behaviour(parity, task)
