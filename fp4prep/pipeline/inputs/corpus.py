"""The calibration corpus: half the user's conversations, half general text, by tokens.

Conversations go through the model's own chat template (tools included). A fixed share of them
is held back, never calibrated on, for the parity check against the BF16 model.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4prep.hashing import file_sha256

from ..config import CorpusStats
from ..errors import UserError
from . import conversations, general_text


@dataclass
class ParityExample:
    """A held-back sample: the full token sequence, the prompt for a greedy continuation, and
    where in the sequence the assistant answers (``[start, end)`` token ranges)."""

    input_ids: list[int]
    prompt_ids: list[int]
    answer_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Corpus:
    sequences: list[list[int]]  # token IDs, sequence_length each
    parity: list[ParityExample]
    stats: CorpusStats
    held_out_lines: list[int] = field(default_factory=list)


def _template_kwargs(conversation: conversations.Conversation) -> dict[str, Any]:
    return {"tools": conversation.tools} if conversation.tools else {}


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Templates without tool-call support concatenate content; None would break them.
    return [m if m.get("content") is not None else {**m, "content": ""} for m in messages]


def render(tokenizer: Any, conversation: conversations.Conversation) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            _messages(conversation.messages), tokenize=False, **_template_kwargs(conversation)
        )
    except Exception as exc:  # jinja raises its own types for template misuse
        raise UserError(
            f"calibration file line {conversation.line}: the model's chat template "
            f"could not render this conversation ({exc})"
        ) from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]], conversation: conversations.Conversation, **kwargs: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **_template_kwargs(conversation), **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_spans(tokenizer: Any, conversation: conversations.Conversation, ids: list[int]) -> list[tuple[int, int]]:
    """The token ranges of ``ids`` (the rendered conversation) that are assistant turns: from the
    end of the template's generation prompt to the end of the turn (its end-of-turn token too).
    A turn whose rendering is not a prefix of the whole (a template that rewrites history) is left out."""
    messages = _messages(conversation.messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or k == 0:
            continue
        start = len(before := _template_ids(tokenizer, messages[:k], conversation, add_generation_prompt=True))
        end = len(through := _template_ids(tokenizer, messages[: k + 1], conversation))
        if ids[:start] == before and ids[: min(end, len(ids))] == through[: len(ids)] and start < min(end, len(ids)):
            spans.append((start, min(end, len(ids))))
    return spans


def render_prompt(tokenizer: Any, conversation: conversations.Conversation) -> list[int]:
    """The conversation up to its last assistant turn, ready for the model to answer."""
    messages = _messages(conversation.messages)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    head = messages[:last] or messages[:1]
    text = tokenizer.apply_chat_template(
        head, tokenize=False, add_generation_prompt=True, **_template_kwargs(conversation)
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _take(streams: Iterable[list[int]], budget: int) -> list[int]:
    tokens: list[int] = []
    for ids in streams:
        tokens.extend(ids)
        if len(tokens) >= budget:
            return tokens[:budget]
    return tokens


def _chunks(tokens: list[int], length: int) -> list[list[int]]:
    return [tokens[i : i + length] for i in range(0, len(tokens) - length + 1, length)]


@dataclass
class _UserHalf:
    tokens: list[int] = field(default_factory=list)
    parity: list[ParityExample] = field(default_factory=list)
    held_lines: list[int] = field(default_factory=list)
    conversations: int = 0
    sha256: str | None = None


def build(
    tokenizer: Any,
    *,
    calibration_file: Path | None,
    general_text_file: Path | None,
    total_tokens: int,
    sequence_length: int,
    user_token_minimum: int,
    holdout_fraction: float,
    parity_prompts: int,
    seed: int,
    report: Callable[[float], None] = lambda f: None,
) -> Corpus:
    user = _UserHalf()
    if calibration_file is not None:
        user = _user_half(
            tokenizer, calibration_file, total_tokens // 2, sequence_length, user_token_minimum,
            holdout_fraction, parity_prompts, random.Random(seed), report,
        )
    # Half and half: as much general text as the user's conversations gave.
    general_budget = len(user.tokens) if calibration_file is not None else total_tokens
    docs = general_text.documents(general_text_file)
    general_stream = (list(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)
    general_tokens = _take(general_stream, general_budget + parity_prompts * sequence_length)
    report(0.9)
    if len(general_tokens) < min(general_budget, sequence_length):
        raise UserError("the general text source is too small for one calibration sequence")
    spare = general_tokens[general_budget:]
    general_tokens = general_tokens[:general_budget]
    parity = user.parity
    if not parity:
        # Without held-back conversations, parity runs on general text never calibrated on.
        for ids in _chunks(spare, sequence_length)[:parity_prompts]:
            # General text has no turns: the part after the prompt stands for the answer.
            parity.append(ParityExample(ids, ids[: sequence_length // 4], [(sequence_length // 4, len(ids))]))
    if not parity:
        raise UserError("no held-back text is left for the parity check: provide more data")
    user_sequences, general_sequences = _chunks(user.tokens, sequence_length), _chunks(general_tokens, sequence_length)
    stats = CorpusStats(
        user_tokens=sum(len(s) for s in user_sequences),
        general_tokens=sum(len(s) for s in general_sequences),
        conversations=user.conversations,
        held_out_conversations=len(user.held_lines),
        sequences=len(user_sequences) + len(general_sequences),
        calibration_sha256=user.sha256,
    )
    return Corpus(_interleaved(user_sequences, general_sequences), parity, stats, user.held_lines)


def _interleaved(first: list[list[int]], second: list[list[int]]) -> list[list[int]]:
    """One of each in turn, then the rest of the longer."""
    sequences = [s for pair in zip(first, second, strict=False) for s in pair]
    longer = first if len(first) > len(second) else second
    return sequences + longer[min(len(first), len(second)) :]


def _user_half(
    tokenizer: Any,
    calibration_file: Path,
    half: int,
    sequence_length: int,
    user_token_minimum: int,
    holdout_fraction: float,
    parity_prompts: int,
    rng: random.Random,
    report: Callable[[float], None],
) -> _UserHalf:
    """The user's conversations: up to ``half`` tokens to calibrate on, and a share held back for
    the parity check (its examples and their lines)."""
    sha256 = file_sha256(calibration_file)
    convs = conversations.read(calibration_file)
    order = list(range(len(convs)))
    rng.shuffle(order)
    n_held = min(max(1, round(len(convs) * holdout_fraction)), len(convs) - 1) if len(convs) > 1 else 0
    held, kept = sorted(order[:n_held]), order[n_held:]
    rendered = []
    for i, index in enumerate(kept):
        rendered.append(render(tokenizer, convs[index]))
        if sum(map(len, rendered)) >= half:
            break
        if i % 16 == 0:
            report(0.5 * i / max(1, len(kept)))
    tokens = _take(rendered, half)
    held_rendered: dict[int, list[int]] = {}  # rendered once, when the minimum needs them counted
    if len(tokens) < half:
        # A file smaller than its half of the corpus: the minimum counts every token the user
        # supplied, the held-back conversations too, and the general half shrinks to match.
        held_rendered.update((i, render(tokenizer, convs[i])) for i in held)
        held_tokens = sum(map(len, held_rendered.values()))
        supplied = len(tokens) + held_tokens
        needed = max(user_token_minimum, held_tokens + sequence_length)
        if supplied < needed or len(tokens) < sequence_length:
            raise UserError(
                f"the calibration file supplies {supplied:,} tokens after the chat template, and at least "
                f"{needed:,} are needed (one calibration sequence is {sequence_length:,} tokens, and "
                f"{len(held):,} conversations are held back for the parity check): add more conversations and retry"
            )
    parity = []
    for index in held[:parity_prompts]:
        ids = (held_rendered.get(index) or render(tokenizer, convs[index]))[:sequence_length]
        prompt = render_prompt(tokenizer, convs[index])[: sequence_length // 2]
        parity.append(ParityExample(ids, prompt, answer_spans(tokenizer, convs[index], ids)))
    return _UserHalf(tokens, parity, [convs[i].line for i in held], len(convs), sha256)
