"""Incremental detokenizer tests against the real SmolLM2 tokenizer (byte-level BPE)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_reference import hf_tokenizer
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.tokenizer import Tokenizer

_MODELS = Path("/root/.cache/sluice/models")
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FFFD = "\ufffd"

TEXTS = [
    "Hello, world!",
    "Héllo wörld, ça va? Ñandú, naïve café",
    "Emoji: 😀🎉 👍🏽 and a family 👨‍👩‍👧 🇫🇷 flag",
    "中文测试：你好，世界！日本語のテキスト、한국어",
    "  leading spaces\n\n\ttabs\t and   runs   of spaces \r\n  ",
    "mixed 世界😀é\u00a0nbsp\u200bzero-width 🤗 end",
    "def f(x):\n    return x ** 2  # 🐍\n",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if not (_MODELS / _GGUF).exists():
        pytest.skip(f"{_GGUF} not in {_MODELS}")
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_tokenizer(_MODELS / _GGUF).save_pretrained(folder)
    return Tokenizer.from_hf_folder(folder)


def stream(
    tok: Tokenizer,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
    stop: Optional[list[str]] = None,
    include_stop: bool = False,
    skip_special_tokens: bool = True,
    expected: Optional[str] = None,
) -> tuple[list[str], Optional[str], IncrementalDetokenizer]:
    """Feed ids one at a time; check the streaming invariants; return the deltas (flush last)."""
    detok = IncrementalDetokenizer(
        tok, prompt_ids, skip_special_tokens=skip_special_tokens,
        stop=stop or [], include_stop_str_in_output=include_stop,
    )
    deltas: list[str] = []
    matched: Optional[str] = None
    for tid in output_ids:
        delta, matched = detok.add_tokens([tid])
        deltas.append(delta)
        assert detok.text == "".join(deltas)
        if expected is not None:
            # nothing is ever emitted that the final text does not keep
            assert expected.startswith(detok.text), (detok.text, expected)
        if matched is not None:
            break
    if matched is None:
        deltas.append(detok.flush())
    return deltas, matched, detok


def truncate_at_stop(text: str, stop: str, include: bool) -> tuple[str, Optional[str]]:
    pos = text.find(stop)
    if pos == -1:
        return text, None
    return text[: pos + len(stop) if include else pos], stop


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    assert full == text  # byte-level BPE round-trips
    deltas, matched, detok = stream(tokenizer, ids, expected=full)
    assert matched is None and detok.finished
    assert "".join(deltas) == full == detok.text
    assert not any(_FFFD in d for d in deltas)


def test_split_character_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    partial = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith(_FFFD)]
    assert partial, "the emoji should span several tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    texts = []
    for tid in ids:
        detok.add_tokens([tid])
        texts.append(detok.text)
    assert all(_FFFD not in t for t in texts)
    assert texts[-1] == "a😀"


def test_incomplete_character_at_end_is_released_as_decode_does(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]).endswith(_FFFD))
    deltas, _, _ = stream(tokenizer, ids[:cut])
    assert not any(_FFFD in d for d in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids[:cut])
    assert deltas[-1].endswith(_FFFD)  # only the final flush carries the broken character


def test_prompt_context_and_multi_token_steps(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Say hi 👋"}]), add_special_tokens=False
    )
    out_ids = tokenizer.encode("Hi there 👋😀! 世界", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_tokens(out_ids[i : i + 3])[0] for i in range(0, len(out_ids), 3)]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(out_ids)
    assert not any(_FFFD in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    ids = tokenizer.encode("Hello<|im_end|>\n<|im_start|>assistant 😀", add_special_tokens=False)
    assert any(i in tokenizer.special_token_ids for i in ids)
    deltas, _, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_string_split_across_tokens_never_leaks(tokenizer: Tokenizer) -> None:
    text = "The answer is forty-two. STOP_HERE and nothing more"
    stop = "STOP_HERE"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]) != text and len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    expected, _ = truncate_at_stop(text, stop, include=False)
    deltas, matched, detok = stream(tokenizer, ids, stop=[stop], expected=expected)
    assert matched == stop and detok.stop_reason == stop and detok.finished
    assert "".join(deltas) == detok.text == expected == "The answer is forty-two. "
    assert detok.add_tokens(ids[-1:]) == ("", None) and detok.flush() == ""


def test_stop_string_with_emoji_and_inside_a_token(tokenizer: Tokenizer) -> None:
    text = "Start 世界😀 end of 👍🏽 line"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cases = [("😀 end", "Start 世界"), ("界😀", "Start 世"), ("ar", "St"), ("👍", "Start 世界😀 end of ")]
    for stop, cut in cases:
        deltas, matched, _ = stream(tokenizer, ids, stop=[stop], expected=cut)
        assert matched == stop
        assert "".join(deltas) == cut
        assert not any(_FFFD in d for d in deltas)


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    text = "alpha beta<END>gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected, _ = truncate_at_stop(text, "<END>", include=True)
    deltas, matched, detok = stream(tokenizer, ids, stop=["<END>"], include_stop=True, expected=expected)
    assert matched == "<END>"
    assert "".join(deltas) == detok.text == "alpha beta<END>"


def test_unmatched_stop_holds_back_then_flushes(tokenizer: Tokenizer) -> None:
    text = "abc abd abe"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["abcdef", "xyz"])
    for tid in ids:
        delta, matched = detok.add_tokens([tid])
        assert matched is None
    assert detok.text == text[: len(text) - 5]  # the longest stop string minus one is held back
    assert detok.flush() == text[len(text) - 5 :]
    assert detok.text == text and detok.stop_reason is None


def test_earliest_of_several_stop_strings(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["four", "two", "three"])
    delta, matched = detok.add_tokens(ids)  # all at once: "two" starts first
    assert (delta, matched) == ("one ", "two")


_PIECES = ["hello", " world", "é", "ñ", "世界", "日本語", "😀", "👍🏽", "👨‍👩‍👧", "🤗", " ", "  ", "\n",
           "\t", ".", "!", "ab", "xyz", "ü", "€", "ß"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=4)), min_size=1, max_size=25),
    stop_span=st.one_of(st.none(), st.tuples(st.integers(0, 200), st.integers(1, 6))),
    include=st.booleans(),
)
def test_random_text_streams_exactly(
    tokenizer: Tokenizer, pieces: list[str], stop_span: Optional[tuple[int, int]], include: bool
) -> None:
    text = "".join(pieces).replace(_FFFD, "")
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    stops: list[str] = []
    if stop_span is not None and text:
        start = stop_span[0] % len(text)
        stops = [text[start : start + stop_span[1]]]
    expected, expected_stop = truncate_at_stop(full, stops[0], include) if stops else (full, None)
    deltas, matched, detok = stream(tokenizer, ids, stop=stops, include_stop=include, expected=expected)
    assert "".join(deltas) == expected == detok.text
    assert matched == expected_stop
    if _FFFD not in full:  # some rare characters lack byte tokens in this vocabulary
        assert not any(_FFFD in d for d in deltas)
