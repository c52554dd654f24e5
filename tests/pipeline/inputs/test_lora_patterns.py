"""What an adapter config's rank and alpha patterns may cost: repeats bounded before compiling,
nothing left in the engine's cache, module names' length counted, one time budget per upload."""

from __future__ import annotations

import sys
import time

import pytest
import regex

from fp4prep.pipeline import UserError
from fp4prep.pipeline.inputs.adapter_files import check_config
from fp4prep.pipeline.inputs.lora_patterns import PATTERN_MAX_STEPS, Patterns, expanded_size, match_budget

MODULES = [f"model.layers.{i}.self_attn.q_proj" for i in range(30)]


def config(**keys: int) -> dict:
    return {"peft_type": "LORA", "r": 8, "rank_pattern": keys}


@pytest.mark.parametrize(
    ("key", "size"),
    [
        ("q_proj", 6),
        (r"layers\.\d+\.q_proj", 16),
        ("(?:x{1024}){1024}", 1024 * 1024),
        ("(?:ab{2,8}){3}", 27),
        (r"[{}]{3}\p{L}{2}", 5),
        ("a{,5}", 5),
        ("x{" + "9" * 5000 + "}", 10**7),
    ],
)
def test_the_expanded_size_counts_repeats_as_written_out(key: str, size: int) -> None:
    assert expanded_size(key) == size


@pytest.mark.parametrize("key", ["(?:x{1024}){1024}", "(?:x{65535}){65535}", "(?:(?:a{64}){64}){64}"])
def test_a_key_that_repeats_into_megabytes_is_refused_before_it_is_compiled(key: str) -> None:
    engine = sys.modules[regex.compile.__module__]
    cached = len(engine._cache)
    started = time.process_time()
    with pytest.raises(UserError, match=r"rank_pattern key .* repeats too much: written out it is [\d,]+ characters, at most 4,096"):
        check_config(config(**{key: 4}), MODULES)
    assert time.process_time() - started < 0.5 and len(engine._cache) == cached


def test_accepted_keys_stay_out_of_the_engines_cache_and_each_module_is_matched_once() -> None:
    engine = sys.modules[regex.compile.__module__]
    cached = len(engine._cache)
    with match_budget(1.0):
        patterns = Patterns.of(config(**{r"layers\.1\d\.self_attn\.q_proj": 16}), "rank_pattern")
        assert Patterns.of(config(**{r"layers\.1\d\.self_attn\.q_proj": 16}), "rank_pattern") is patterns
        assert [patterns.value(m, 8) for m in MODULES] == [8] * 10 + [16] * 10 + [8] * 10
        assert len(patterns._matched) == len(MODULES)
    assert Patterns.of(config(), "rank_pattern") is not Patterns.of(config(), "rank_pattern")  # outside a budget: fresh
    assert len(engine._cache) == cached


def test_long_module_names_count_in_the_cost_before_anything_is_matched() -> None:
    keys = {f".*.*[^a.]{i}": 4 for i in range(64)}
    long_names = [f"model.layers.{i}." + "x" * 2400 for i in range(2)]
    started = time.process_time()
    with pytest.raises(UserError, match=r"matching them against the adapter's 2 modules takes 4,864 steps"):
        Patterns(config(**keys), "rank_pattern").check_cost(long_names, 4_000)
    assert time.process_time() - started < 0.5
    # The same keys against short names cost a step each.
    Patterns(config(**keys), "rank_pattern").check_cost(MODULES, PATTERN_MAX_STEPS)


def test_matching_stops_when_the_uploads_time_is_spent() -> None:
    patterns = Patterns(config(**{r"(?:.*.*)*[^a.]Z": 4}), "rank_pattern")
    with match_budget(0.0), pytest.raises(UserError, match=r"takes more than 0 s; name the modules plainly"):
        patterns.value("model.layers.0." + "x" * 2400, 8)
