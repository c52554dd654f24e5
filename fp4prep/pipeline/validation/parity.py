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
from ..errors import PipelineError
from ..inputs.corpus import ParityExample
from ..model import layer_walk
from . import continuations
from .prompt_cache import FirstRun, PromptCache, Runs, kv_budget
from .task import TaskSet

# Teacher-forced parity runs the decoder over batches of at most this many tokens (all of them
# through each layer while it is in: one pass over a streamed model's layers for the whole set),
# then applies the output head to at most LOGITS_BYTES of logits at once.
TOKENS_PER_PASS = 16384
LOGITS_BYTES = 64 << 20


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The logits of one sequence, [len, vocab] in float32 on the CPU."""
    ids_tensor, mask = padded([ids], _device(model))
    return model(ids_tensor, attention_mask=mask, use_cache=False).logits[0].float().cpu()


def padded(sequences: list[list[int]], device: torch.device, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences padded into one batch (on the right, or on the ``left`` so that each ends at
    the last column), and its attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        place = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, place] = torch.tensor(seq)
        mask[row, place] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def final_hidden_states(
    model: Any, sequences: list[list[int]], cache: PromptCache | None = None, alone: list[list[int]] | None = None
) -> list[torch.Tensor]:
    """Each sequence's last hidden states (after the final norm), ``[len, hidden]``; then those of
    each ``alone`` sequence, run as a batch of its own (as a forward of it by itself computes them).

    Sequences are batched shortest first, at most ``TOKENS_PER_PASS`` tokens a batch, so that little
    of a batch is padding. Each decoder layer runs every batch while it is in (``layer_walk``): on
    a streamed model, one read of every layer for the whole set. With ``cache``, the keys and values
    of the prompts it keeps are kept too.
    """
    device = _device(model)
    everything, batches, inputs = batched(sequences, device, alone)
    if cache is None:
        hidden = layer_walk.final_states(model, inputs)
    else:
        assert not alone, "sequences run alone keep no keys and values"
        hidden = layer_walk.final_states(model, inputs, cache, lambda b: cache.recording(batches[b], device))
    return unbatched(everything, batches, hidden)


def batched(
    sequences: list[list[int]], device: torch.device, alone: list[list[int]] | None = None
) -> tuple[list[list[int]], list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """How ``final_hidden_states`` runs ``sequences`` and ``alone``: all of them, their indices in
    batches, and each batch padded (ids, attention mask)."""
    everything = sequences + (alone or [])
    batches = _batches(sequences) + [[len(sequences) + k] for k in range(len(alone or []))]
    return everything, batches, [padded([everything[j] for j in batch], device) for batch in batches]


def unbatched(everything: list[list[int]], batches: list[list[int]], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence's states, out of its batch's (``batched``), without the padding."""
    states: list[torch.Tensor] = [torch.empty(0)] * len(everything)
    for batch, out in zip(batches, hidden, strict=True):
        for row, j in enumerate(batch):
            states[j] = out[row, : len(everything[j])]
    return states


def _batches(sequences: list[list[int]]) -> list[list[int]]:
    """The sequences' indices in batches of at most ``TOKENS_PER_PASS`` tokens with padding, shortest
    first."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches: list[list[int]] = []
    batch: list[int] = []
    for k, i in enumerate(order):
        batch.append(i)
        # Sorted: the next sequence is the longest the batch would hold.
        if k == len(order) - 1 or (len(batch) + 1) * len(sequences[order[k + 1]]) > TOKENS_PER_PASS:
            batches.append(batch)
            batch = []
    return batches


def prefix_states(model: Any, sequences: list[list[int]], alone: list[list[int]] | None = None) -> list[torch.Tensor]:
    """``final_hidden_states`` of each sequence, those that start a longer one (a prompt and the
    held-back answer the BF16 model gave again, within its conversation) read off that one's run:
    states depend only on the tokens before them. Then those of the ``alone`` sequences, each run
    by itself."""
    owner = [
        min(range(len(sequences)), key=lambda j: (sequences[j][: len(s)] != s, -len(sequences[j]), j))
        for s in sequences
    ]
    run = sorted(set(owner))
    found = final_hidden_states(model, [sequences[j] for j in run], alone=alone)
    states = dict(zip(run, found, strict=False))
    return [states[j][: len(s)] for j, s in zip(owner, sequences, strict=True)] + found[len(run) :]


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


def end_of_turn(model: Any) -> set[int]:
    """The tokens that end the model's turn (its generation config's end-of-sequence IDs)."""
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [])


@dataclass
class Reload:
    """The reload check, done in a candidate's run: ``reference`` is the calibrated model's logits on
    ``ids`` (a forward of that sequence by itself)."""

    reference: torch.Tensor
    ids: list[int]


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
    done: FirstRun | None = None,
) -> Reference:
    """The BF16 model's greedy continuations of the held-back prompts and its final hidden states
    over everything candidates are compared on, in as few runs of the decoder as ``verified_greedy``
    needs: the conversations and the task's answers run with its first round, or with ``done``
    where that round already ran (``first_round``)."""
    fixed, prompts, drafts = _checked(examples, task)
    found = verified_greedy(model, prompts, drafts, continuation_tokens, fixed, lambda f: report(0.9 * f), done)
    n = len(examples)
    states = found.alongside[:n] + found.states + found.alongside[n:]
    ref = Reference(model, examples, continuation_tokens, found.tokens, states, task)
    if task is not None:
        with output_head(model) as head:
            ref.task_success = task.success(ref.states[2 * n :], head)
    report(1.0)
    return ref


def _checked(examples: list[ParityExample], task: TaskSet | None) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """What the BF16 side checks: the sequences run alongside (conversations, the task's answers),
    the prompts and their drafts."""
    fixed = [e.input_ids for e in examples] + (task.sequences if task else [])
    return fixed, [e.prompt_ids for e in examples], [continuations.draft(e) for e in examples]


def first_round_plan(
    examples: list[ParityExample], continuation_tokens: int, task: TaskSet | None
) -> tuple[list[list[int]], dict[int, tuple[int, int]]]:
    """The sequences ``reference_of``'s first round runs and the keys and values it keeps."""
    fixed, prompts, drafts = _checked(examples, task)
    sequences, keep, _ = continuations.first_round_plan(prompts, [d[:continuation_tokens] for d in drafts], fixed)
    return sequences, keep


def verified_greedy(
    model: Any,
    prompts: list[list[int]],
    drafts: list[list[int]],
    n: int,
    alongside: list[list[int]] | None = None,
    report: Callable[[float], None] = lambda f: None,
    done: FirstRun | None = None,
) -> continuations.Verified:
    """``continuations.verified_greedy`` on ``model``, run and read as everything here is."""
    runs = Runs(model, final_hidden_states, kv_budget(model), done)
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
    reload_difference: float | None = None


def compare(
    ref: Reference, candidate: Any, report: Callable[[float], None] = lambda f: None, reload: Reload | None = None
) -> Behaviour:
    """``candidate`` against the BF16 model's ``ref``, all teacher-forced in one run of the
    candidate's decoder: over whole conversations, their answers and the BF16 model's continuations,
    and on the adapter's task; and, given ``reload``, the largest difference between its logits and
    the calibrated model's, its example run as a batch of its own in the same walk of the layers.

    A candidate's greedy continuation is identical to the BF16 model's exactly when, fed that
    continuation, it picks each of its tokens in turn: so the identical share needs no decoding.
    """
    examples, prompts, expected = ref.examples, ref.prompts, ref.expected
    got_states = prefix_states(candidate, ref.sequences, [reload.ids] if reload is not None else None)
    report(0.8)
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
                got_ref = reference_head(ref.states[index][part.to(ref.states[index].device)])
                got = candidate_head(got_states[index][part.to(got_states[index].device)])
                for name, positions in reads.items():
                    pick = torch.isin(part, positions)
                    if not bool(pick.any()):
                        continue
                    tallies[name].add(got_ref[pick], got[pick])
                    if name == "continuations":
                        chosen.setdefault(index, []).extend(got[pick].argmax(-1).tolist())
        task = ref.task.success(got_states[2 * n : len(ref.sequences)], candidate_head) if ref.task is not None else None
        reload_difference = float((candidate_head(got_states[-1]) - reload.reference).abs().max()) if reload else None
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
    return Behaviour(parity, task, reload_difference)
