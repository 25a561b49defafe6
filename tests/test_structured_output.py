"""Structured outputs' pieces on hand-built inputs: the params, the compiler and its cache, the
grammar state's masks (now and after drafts), the bitmask arithmetic and the sampler's use of it.

The grammars run on SmolLM2's real tokenizer (a 49,152-token BPE vocabulary), since what a mask
allows depends on how the vocabulary splits text. Whole-model runs are in test_model_smollm2.py
and through the server in test_server_structured.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from sluice.engine.request import Request
from sluice.engine.sampler import Sampler, SamplingRow
from sluice.engine.spec_decode import NgramProposer
from sluice.engine.structured_output import (
    GrammarCompiler,
    allowed_tokens,
    apply_token_masks,
    leaves_a_token,
    mask_words,
)
from sluice.config import SpeculativeConfig
from sluice.sampling_params import SamplingParams, StructuredOutputsParams as SO

try:
    from sluice.model.default import ensure_default_model
    MODEL = ensure_default_model()
except Exception:  # noqa: BLE001 -- the default-model helper is optional here
    MODEL = Path("/root/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf")

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    if not Path(MODEL).is_file():
        pytest.skip(f"{MODEL} is not available")
    from sluice.model.loader import load_tokenizer

    return load_tokenizer(Path(MODEL))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.info.tokenizer_json, VOCAB, tokenizer.eos_token_ids)


def allowed(mask: torch.Tensor) -> set[int]:
    return set(allowed_tokens(mask.unsqueeze(0), VOCAB)[0].nonzero().flatten().tolist())


def texts(tokenizer, ids) -> set[str]:
    return {tokenizer.decode([i], skip_special_tokens=False) for i in ids}


# --- the params --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": {"type": "object"}, "json_object": True}, "exactly one"),
    ({"choice": []}, "non-empty"),
    ({"choice": ["a", ""]}, "non-empty"),
    ({"json": "{not json"}, "not a valid JSON schema text"),
    ({"json": "[1, 2]"}, "must be an object"),
    ({"regex": "a", "disable_any_whitespace": True}, "json and json_object only"),
    ({"structural_tag": "{"}, "not valid JSON text"),
    ({"structural_tag": {"format": {"type": "triggered_tags"}}}, "xgrammar"),
    ({"structural_tag": {"structures": [], "triggers": ["<f"]}}, "non-empty list"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": []}}, "non-empty list"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f"]}}, "begin"),
    ({"structural_tag": {"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]}},
     "none of the triggers"),
])
def test_params_take_exactly_one_valid_constraint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SO(**kwargs)


def test_structural_tags_free_text_until_a_trigger_then_the_schema(compiler, tokenizer):
    """Free text may be anything but a trigger; after one, the begin string, then JSON of the
    schema (an object opens; the few-shot examples' "city" key is refused), then the end."""
    schema = {"type": "object", "additionalProperties": False, "required": ["town"],
              "properties": {"town": {"type": "string"}}}
    spec = SO(structural_tag={"triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}]})
    reordered = SO(structural_tag=json.dumps({"structures": [
        {"schema": schema, "end": "</function>", "begin": "<function=get_weather>"}], "triggers": ["<function="]}))
    assert spec.kind == "structural_tag" and spec.key() == reordered.key()
    state = compiler.compile(spec).new_state()
    assert len(allowed(state.masks()[0])) > 40000                  # free text: nearly every token
    for t in tokenizer.encode("Sure. <function=get_weather>{\"", add_special_tokens=False):
        assert t in allowed(state.masks()[0]), tokenizer.decode([t])
        state.consume(t)
    following = texts(tokenizer, allowed(state.masks()[0]))
    assert any(t.startswith("town") for t in following) and not any(t.startswith("city") for t in following)


def test_params_key_is_canonical():
    a = SO(json={"type": "object", "properties": {"a": {"type": "string"}}})
    b = SO(json='{"properties": {"a": {"type": "string"}}, "type": "object"}')
    assert a.key() == b.key() and a.kind == "json"
    assert SO(choice=["x", "y"]).key() != SO(choice=["y", "x"]).key()
    assert SO(json_object=True).kind == "json_object"


def test_empty_schema_and_empty_regex_are_constraints_too(compiler, tokenizer):
    assert SO(json={}).kind == "json" and SO(regex="").kind == "regex"
    anything = compiler.compile(SO(json={})).new_state()   # any JSON value
    assert {"{", "[", "1", "true"} <= texts(tokenizer, allowed(anything.masks()[0]))
    empty = compiler.compile(SO(regex="")).new_state()     # only the empty string: end at once
    assert allowed(empty.masks()[0]) == set(tokenizer.eos_token_ids)


def test_leaves_a_token_on_hand_built_masks():
    mask = _bitmask([2, 31, 40], VOCAB)
    assert leaves_a_token(mask, [2]) and leaves_a_token(mask, [2, 31])
    assert not leaves_a_token(mask, [2, 31, 40])
    assert not leaves_a_token(_bitmask([31], VOCAB), [31])   # the sign bit of an int32 word
    assert leaves_a_token(mask, [VOCAB + 5])                   # ids past the vocabulary are ignored


# --- the compiler -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    (SO(regex="[0-9"), "invalid regular expression"),
    (SO(json={"type": "foo"}), "invalid JSON schema"),
    (SO(grammar="start: undefined_rule"), "invalid grammar"),
    (SO(grammar="this is not a grammar ::= ["), "invalid grammar"),
])
def test_invalid_specs_raise_value_errors(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_by_their_canonical_text(compiler):
    a = compiler.compile(SO(json={"type": "object", "required": ["a"]}))
    b = compiler.compile(SO(json='{"required": ["a"], "type": "object"}'))
    assert a is b
    assert compiler.compile(SO(json={"type": "array"})) is not a


def test_cache_is_bounded(tokenizer):
    small = GrammarCompiler(tokenizer.info.tokenizer_json, VOCAB, tokenizer.eos_token_ids, cache_size=2)
    first = small.compile(SO(regex="a"))
    small.compile(SO(regex="b"))
    assert small.compile(SO(regex="a")) is first     # a hit moves it to the back
    small.compile(SO(regex="c"))                       # evicts "b", the least recently used
    assert small.compile(SO(regex="a")) is first
    assert len(small._cache) == 2


# --- masks --------------------------------------------------------------------------------------
def test_choice_mask_allows_exactly_the_prefixes_of_the_choices(compiler, tokenizer):
    state = compiler.compile(SO(choice=["yes", "no"])).new_state()
    first = allowed(state.masks()[0])
    assert first and all(("yes".startswith(t) or "no".startswith(t)) and t for t in texts(tokenizer, first))
    assert {tokenizer.encode("yes", add_special_tokens=False)[0],
            tokenizer.encode("no", add_special_tokens=False)[0]} <= first
    for tok in tokenizer.encode("yes", add_special_tokens=False):
        assert state.consume(tok)
    assert state.is_stopped and state.error is None


def test_a_disallowed_token_puts_the_state_in_error(compiler, tokenizer):
    state = compiler.compile(SO(regex="[0-9]+")).new_state()
    assert not state.consume(tokenizer.encode("x", add_special_tokens=False)[0])
    assert state.error is not None


def test_masks_after_drafts_equal_masks_of_states_that_consumed_them(compiler, tokenizer):
    grammar = compiler.compile(SO(regex=r"[0-9]{3}-[0-9]{4}"))
    drafts = tokenizer.encode("123-45", add_special_tokens=False)
    state = grammar.new_state()
    masks = state.masks(drafts)
    assert masks.shape == (len(drafts) + 1, mask_words(VOCAB))
    for i in range(len(drafts) + 1):
        ref = grammar.new_state()
        for tok in drafts[:i]:
            assert ref.consume(tok)
        assert torch.equal(masks[i], ref.masks()[0]), i
    # the state itself did not move: its mask is still the first one
    assert torch.equal(state.masks()[0], masks[0])
    digits = texts(tokenizer, allowed(masks[3]))
    assert digits == {"-"}, digits


def test_drafts_past_the_complete_output_leave_the_state_as_it_was(compiler, tokenizer):
    """Drafts copied from a history run past the token that completes the output into an end
    token (a reply "6." then the turn's end): their masks leave the state where it was. llguidance
    takes an end token after a complete output without counting it, so rolling back every draft
    undid one of the output's own tokens and the next real token was refused (seen end to end)."""
    state = compiler.compile(SO(regex=r"The answer is \d+\.")).new_state()
    for t in tokenizer.encode("The answer is ", add_special_tokens=False):
        assert state.consume(t)
    before = state.masks()[0]
    drafts = tokenizer.encode("6.", add_special_tokens=False) + [tokenizer.eos_token_ids[0]] * 2
    assert state.valid_prefix(drafts) >= 3
    masks = state.masks(drafts)
    assert torch.equal(state.masks()[0], before)
    done = len(drafts) - 2                               # the rows after "." allow only the end
    assert all(allowed(masks[i]) == set(tokenizer.eos_token_ids) for i in range(done, len(drafts) + 1))
    assert state.consume(tokenizer.encode("1", add_special_tokens=False)[0]) and state.error is None


def test_valid_prefix_stops_at_the_first_token_the_grammar_refuses(compiler, tokenizer):
    state = compiler.compile(SO(regex=r"[0-9]{3}-[0-9]{4}")).new_state()
    good = tokenizer.encode("12", add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)
    assert state.valid_prefix(good + bad + good) == len(good)
    assert state.valid_prefix([]) == 0
    assert state.error is None and torch.equal(state.masks()[0], compiler.compile(
        SO(regex=r"[0-9]{3}-[0-9]{4}")).new_state().masks()[0])


def test_end_of_sequence_is_the_only_token_once_the_output_is_complete(compiler, tokenizer):
    state = compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"], "additionalProperties": False})).new_state()
    for tok in tokenizer.encode('{"a": 7', add_special_tokens=False):
        assert state.consume(tok), tok
    after_number = texts(tokenizer, allowed(state.masks()[0]))
    assert "}" in after_number and "x" not in after_number
    for tok in tokenizer.encode("}", add_special_tokens=False):
        assert state.consume(tok)
    eos = tokenizer.eos_token_ids[0]
    assert allowed(state.masks()[0]) == {eos}
    assert state.consume(eos) and state.is_stopped


def test_proposer_cuts_drafts_to_what_the_grammar_allows(compiler, tokenizer):
    def Req(ids, grammar):
        return Request("r", ids, SamplingParams(), 16, 0.0, grammar=grammar)

    text = "123-4567 and 123-4567 and 123"
    ids = tokenizer.encode(text, add_special_tokens=False)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=6))
    free = proposer.propose(Req(list(ids), None), 6)
    assert len(free) == 6
    state = compiler.compile(SO(regex=r"[0-9]{3}-[0-9]{4}")).new_state()
    for tok in tokenizer.encode("123", add_special_tokens=False):
        assert state.consume(tok)
    cut = proposer.propose(Req(list(ids), state), 6)
    assert cut == free[:state.valid_prefix(free)]
    assert 0 < len(cut) < len(free)   # "-4567" is allowed, " and" is not
    assert re.fullmatch(r"-[0-9]{4}", tokenizer.decode(cut))


def test_a_grammar_waits_for_the_thought_the_prompt_opened(compiler, tokenizer):
    """A request whose prompt opens a thought: its grammar constrains nothing (no masks, drafts
    uncut) until the thought's end tag, then everything after it; drafts across the end tag get
    masks from there and are cut where the grammar refuses; a tail dropped back into the thought
    leaves the grammar as if it had seen nothing."""
    from sluice.engine.thinking import ThinkingTags, ThoughtTracker

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    tags = ThinkingTags(tuple(enc("<think>")), tuple(enc("</think>")), tuple(enc("</think>")))
    prompt = enc("Question?") + enc("<think>")
    grammar = compiler.compile(SO(regex=r"The answer is \d+\.")).new_state()
    req = Request("r", prompt, SamplingParams(), 64, 0.0, grammar=grammar,
                  thinking=ThoughtTracker(tags, None, prompt))
    assert not req.constrained and req.grammar_masks(enc("Hmm, six")) is None
    thought, end, answer = enc("Hmm."), enc("</think>"), enc("The answer is 6. Yes")
    drafts = thought + end + answer
    masks = req.grammar_masks(thought + end + answer[:2])
    c = len(thought) + len(end)
    assert all(m is None for m in masks[:c]) and all(m is not None for m in masks[c:])
    assert torch.equal(masks[c], compiler.compile(SO(regex=r"The answer is \d+\.")).new_state().masks()[0])
    shaped = req.shape_drafts(list(drafts), len(drafts))
    assert tokenizer.decode(shaped) == "Hmm.</think>The answer is 6."   # " Yes" is refused
    for t in thought + end:
        req.append_output_token(t)
    assert req.constrained and req.grammar_start == c
    for t in answer[:2]:
        req.append_output_token(t)
    assert req.error is None and req.grammar.valid_prefix(answer[2:3]) == 1
    req.drop_output_tail(2 + len(end))                   # back inside the thought
    assert not req.constrained and req.grammar_masks() is None
    for t in end + enc("The"):
        req.append_output_token(t)
    assert req.constrained and req.error is None and req.grammar.valid_prefix(enc(" answer")) == 1


def test_a_one_token_start_tag_may_open_a_thought_at_the_first_token(compiler, tokenizer):
    """Tags whose start is one token (Qwen3's, GLM's; here SmolLM2's "Thinking"): a constrained
    reply whose prompt opens no thought may open one with its first token. That position allows
    the grammar's tokens and the start tag; drafts opening the thought get no mask inside it and
    the grammar's after it; a first token that opens none is the answer's (the grammar takes it),
    and dropping it makes the choice open again."""
    from sluice.engine.thinking import ThinkingTags, ThoughtTracker

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    [start], end = enc("Thinking"), tuple(enc(" So:"))
    tags = ThinkingTags((start,), end, end)
    spec = SO(regex=r" The answer is \d+\.")
    prompt = enc("Question?")
    req = Request("r", prompt, SamplingParams(), 64, 0.0, grammar=compiler.compile(spec).new_state(),
                  thinking=ThoughtTracker(tags, None, prompt))
    plain = compiler.compile(spec).new_state().masks()[0]
    assert not req.constrained and req.thought_start == start
    [first] = req.grammar_masks()
    assert allowed(first) == allowed(plain) | {start} and start not in allowed(plain)
    thought, answer = enc(" hm"), enc(" The answer")
    masks = req.grammar_masks([start, *thought, *end, *answer])
    c = 1 + len(thought) + len(end)
    assert torch.equal(masks[0], first) and all(m is None for m in masks[1:c]) and torch.equal(masks[c], plain)
    masks = req.grammar_masks(answer)
    assert torch.equal(masks[0], first) and allowed(masks[1]) == allowed(compiler.compile(spec).new_state().masks(
        answer)[1])
    assert req.shape_drafts([*answer, *enc(" no")], 8) == answer
    req.append_output_token(answer[0])                     # no thought: the grammar takes it
    assert req.constrained and req.grammar_start == 0 and req.error is None
    req.drop_output_tail(1)
    assert not req.constrained and torch.equal(req.grammar_masks()[0], first)
    for t in [start, *thought, *end]:
        req.append_output_token(t)
    assert req.constrained and req.grammar_start == c and req.error is None
    assert req.grammar.valid_prefix(answer) == len(answer)


# --- bitmasks and the sampler -------------------------------------------------------------------
def _bitmask(ids: list[int], vocab: int) -> torch.Tensor:
    words = [0] * mask_words(vocab)
    for t in ids:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_bitmask_unpacking_on_hand_built_masks():
    ids = [0, 5, 31, 32, 63, 64, 99]
    mask = _bitmask(ids, 100)
    got = allowed_tokens(mask.unsqueeze(0), 100)[0]
    assert got.shape == (100,) and got.nonzero().flatten().tolist() == ids
    logits = torch.zeros(1, 100)
    apply_token_masks(logits, mask.unsqueeze(0))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == ids


def test_sampler_picks_only_allowed_tokens():
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab)
    allowed_ids = [[3, 70], [99], [0, 1, 2], [50]]
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], None, (), _bitmask(a, vocab))
            for a in allowed_ids[:2]]
    rows += [SamplingRow(SamplingParams(temperature=1.0), [], [], torch.Generator().manual_seed(i), (),
                         _bitmask(a, vocab)) for i, a in enumerate(allowed_ids[2:])]
    before = logits.clone()
    sampler = Sampler()
    out = sampler(logits, rows).token_ids.tolist()
    assert out[0] == max(allowed_ids[0], key=lambda t: logits[0, t]) and out[1] == 99 and out[3] == 50
    assert torch.equal(logits, before)
    draws = {sampler(logits, rows).token_ids[2].item() for _ in range(200)}
    assert draws == {0, 1, 2}
    # an unmasked row beside masked ones is sampled as before
    plain = SamplingRow(SamplingParams(temperature=0.0), [], [], None)
    assert sampler(logits[:2], [rows[1], plain]).token_ids.tolist() == [99, logits[1].argmax().item()]


def test_disable_any_whitespace_makes_json_compact(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    flexible, compact = SO(json=schema), SO(json=schema, disable_any_whitespace=True)
    assert flexible.key() != compact.key()
    assert compact.schema()["x-guidance"] == {"whitespace_flexible": False}
    assert SO(json={**schema, "x-guidance": {"whitespace_flexible": True}},
              disable_any_whitespace=True).schema()["x-guidance"] == {"whitespace_flexible": True}

    def after_brace(spec) -> set[str]:
        state = compiler.compile(spec).new_state()
        assert state.consume(tokenizer.encode("{", add_special_tokens=False)[0])
        return texts(tokenizer, allowed(state.masks()[0]))

    assert any(t.isspace() for t in after_brace(flexible))
    assert not any(t.strip() != t for t in after_brace(compact)), after_brace(compact)
    assert not any(t.strip() != t for t in after_brace(SO(json_object=True, disable_any_whitespace=True)))


def test_disable_additional_properties_closes_every_object_schema_and_nothing_else():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},   # a field named so
        "open": {"type": "object", "additionalProperties": True},
        "items": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}},
        "pick": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "data": {"const": {"type": "object", "properties": {}}},                      # data, not a schema
    }, "$defs": {"thing": {"properties": {"z": {}}}}}
    closed = SO(json=schema, disable_additional_properties=True).schema()
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in props                      # the map of properties is not a schema
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["pick"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in props["pick"]["anyOf"][1]
    assert props["data"]["const"] == {"type": "object", "properties": {}}
    assert closed["$defs"]["thing"]["additionalProperties"] is False
    assert "additionalProperties" not in schema                     # the caller's schema is untouched
    assert SO(json=schema).schema() is schema
    with pytest.raises(ValueError, match="apply to json"):
        SO(regex="a", disable_additional_properties=True)
    with pytest.raises(ValueError, match="contradict"):
        SO(json_object=True, disable_any_whitespace=True, whitespace_pattern=" ?")


def test_whitespace_pattern_reaches_the_grammar(compiler, tokenizer):
    spec = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
              whitespace_pattern="[ ]?")
    assert spec.schema()["x-guidance"] == {"whitespace_pattern": "[ ]?"}
    state = compiler.compile(spec).new_state()
    assert state.consume(tokenizer.encode("{", add_special_tokens=False)[0])
    after = texts(tokenizer, allowed(state.masks()[0]))
    assert not any("\n" in t for t in after), after      # newlines are not in the pattern


def test_min_tokens_yields_where_the_grammar_allows_only_the_end(compiler, tokenizer):
    """The runner's rows: min_tokens suppresses the end token while the grammar allows more, and
    not once the grammar allows nothing else (the row would have no token left)."""
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.request import Request

    eos = tokenizer.eos_token_ids
    spec = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                    "additionalProperties": False})
    params = SamplingParams(temperature=0.0, min_tokens=50, max_tokens=60, structured_outputs=spec)
    req = Request("r", [1, 2, 3], params, 60, 0.0, eos, grammar=compiler.compile(spec).new_state())
    for tok in tokenizer.encode('{"a": 7', add_special_tokens=False):
        req.append_output_token(tok)
    [row] = ModelRunner._rows(req, [])
    assert set(row.suppress_token_ids) == set(eos)          # "}" or more digits are still possible
    closing = tokenizer.encode("}", add_special_tokens=False)
    rows = ModelRunner._rows(req, closing)                   # a draft that completes the object
    assert set(rows[0].suppress_token_ids) == set(eos) and rows[1].suppress_token_ids == ()
    logits = torch.zeros(2, VOCAB)
    out = Sampler()(logits, rows).token_ids.tolist()
    assert out[1] == eos[0] and out[0] != eos[0]
