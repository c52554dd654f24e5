"""Calibration files and the calibration corpus: validation, chat template, halves, minimum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fp4prep.pipeline import UserError
from fp4prep.pipeline.inputs import conversations, corpus, general_text
from tests.tiny import write_conversations

from ..helpers import run_tiny

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
TOOL_CALL = {
    "messages": [
        {"role": "user", "content": "Where is order A1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "status", "arguments": '{"id": "A1"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
        {"role": "assistant", "content": "It has shipped."},
    ],
    "tools": [{"type": "function", "function": {"name": "status", "parameters": {"type": "object"}}}],
}


def test_validation_reports_every_bad_line_with_its_number_and_problem() -> None:
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({"text": "no messages"}),
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}),
        "",
        json.dumps(TOOL_CALL),
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]}
        ),
        "[1, 2]",
    ]
    report = conversations.validate(lines)
    assert report.conversations == 2 and [c.line for c in conversations.parse(lines)] == [1, 7]
    assert [(e.line, e.message) for e in report.errors] == [
        (2, "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (3, "messages must be a non-empty list"),
        (4, "messages[0].role must be one of system, user, assistant, tool, not 'robot'"),
        (5, "messages[1]: a tool message needs a tool_call_id"),
        (8, "tools[0].function.name must be a non-empty string"),
        (9, "each line must be a JSON object with a messages list"),
    ]
    assert not report.ok
    assert report.summary().startswith("line 2: not valid JSON")


def test_validation_reports_non_utf8_and_caps_the_list() -> None:
    lines = [b"\xff\xfe"] + [b"{bad"] * 150
    report = conversations.validate(lines)
    assert report.errors[0].message == "not UTF-8 text"
    assert report.error_count == 151 and len(report.errors) == conversations.MAX_REPORTED_ERRORS
    assert report.summary().endswith("and 146 more")


def test_an_empty_file_does_not_pass(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(
        UserError, match="empty.jsonl did not pass validation: the file holds no conversations"
    ):
        conversations.read(path)


def test_conversations_render_through_the_models_chat_template_with_tools(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    (conversation,) = conversations.parse([json.dumps(TOOL_CALL)])
    ids = corpus.render(tokenizer, conversation)
    text = tokenizer.decode(ids)
    assert "<|im_start|>tool" in text and "It has shipped." in text
    prompt = tokenizer.decode(corpus.render_prompt(tokenizer, conversation))
    assert prompt.endswith("<|im_start|>assistant\n") and "It has shipped." not in prompt


def test_too_few_tokens_is_a_user_error_that_says_how_many(llama_base: Path, tmp_path: Path) -> None:
    small = write_conversations(tmp_path / "small.jsonl", 8)
    with pytest.raises(UserError, match=r"supplies [\d,]+ tokens .* at least 4,096 are needed"):
        run_tiny(llama_base, tmp_path / "out", calibration_file=small, user_token_minimum=4096)
    assert not (tmp_path / "out").exists()


def test_the_minimum_counts_every_token_supplied_held_back_conversations_included(tokenizer_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = write_conversations(tmp_path / "c.jsonl", 40)
    supplied = sum(len(corpus.render(tokenizer, c)) for c in conversations.read(path))

    def build(minimum: int) -> corpus.Corpus:
        return corpus.build(
            tokenizer, calibration_file=path, general_text_file=None, total_tokens=2 * minimum, sequence_length=64,
            user_token_minimum=minimum, holdout_fraction=0.1, parity_prompts=4, seed=0,
        )

    # A file of exactly the minimum passes, though a tenth of it is held back for parity: the
    # user's half is what is left, and the general half matches it.
    built = build(supplied)
    assert built.stats.held_out_conversations == 4
    assert 0 < built.stats.user_tokens < supplied and built.stats.user_tokens == built.stats.general_tokens
    with pytest.raises(UserError, match=rf"supplies {supplied:,} tokens .* at least {supplied + 1:,} are needed"):
        build(supplied + 1)


def test_half_the_corpus_is_the_users_and_held_back_conversations_are_never_calibrated_on(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = write_conversations(tmp_path / "c.jsonl", 100)
    built = [
        corpus.build(
            tokenizer,
            calibration_file=path,
            general_text_file=None,
            total_tokens=4096,
            sequence_length=256,
            user_token_minimum=0,
            holdout_fraction=0.1,
            parity_prompts=4,
            seed=3,
        )
        for _ in range(2)
    ]
    first = built[0]
    assert first.stats.user_tokens == first.stats.general_tokens == 2048
    assert first.stats.held_out_conversations == 10 and len(first.parity) == 4
    assert first.held_out_lines == built[1].held_out_lines  # deterministic
    held_questions = {
        json.loads(path.read_text().splitlines()[n - 1])["messages"][0]["content"]
        for n in first.held_out_lines
    }
    calibrated = tokenizer.decode([t for s in first.sequences for t in s])
    assert not any(q in calibrated for q in held_questions)


def test_the_embedded_general_text_is_deterministic_and_a_file_replaces_it(tmp_path: Path) -> None:
    first = list(general_text.default_documents())
    assert first == list(general_text.default_documents())
    assert sum(map(len, first)) > 200_000
    txt = tmp_path / "g.txt"
    txt.write_text("one document\n\nanother document\n")
    assert list(general_text.documents(txt)) == ["one document", "another document"]
    jsonl = tmp_path / "g.jsonl"
    jsonl.write_text('{"text": "a"}\n{"oops": 1}\n')
    with pytest.raises(UserError, match="g.jsonl line 2"):
        list(general_text.documents(jsonl))


def test_validation_keeps_counts_not_conversations() -> None:
    import tracemalloc

    line = json.dumps({"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y" * 200}]})
    tracemalloc.start()
    report = conversations.validate(line for _ in range(20_000))  # ~9 MB of conversations, parsed one at a time
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert report.conversations == 20_000 and report.ok
    assert peak < 1024 * 1024, f"validation held {peak:,} bytes"


def test_answer_spans_are_the_assistant_turns_of_the_rendered_conversation(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    multi = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "still here"},
    ]}
    for row, answers in ((multi, ["hello there", "still here"]), (TOOL_CALL, ["", "It has shipped."])):
        (conversation,) = conversations.parse([json.dumps(row)])
        ids = corpus.render(tokenizer, conversation)
        spans = corpus.answer_spans(tokenizer, conversation, ids)
        texts = [tokenizer.decode(ids[start:end]) for start, end in spans]
        assert [t.removesuffix("<|im_end|>\n").removesuffix("<|im_end|>") for t in texts] == answers, texts
        # Truncated to a prefix, a turn keeps the part that is left.
        cut = spans[-1][0] + 2
        assert corpus.answer_spans(tokenizer, conversation, ids[:cut])[-1] == (spans[-1][0], cut)
