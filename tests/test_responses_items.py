"""The Responses API's pieces without a server: input items -> chat messages, output items and
stream events built from hand-made parser events, the response store."""
from __future__ import annotations

from typing import Any

import pytest

from sluice.server.protocol import APIError
from sluice.server.serving_responses import (
    OutputItems,
    ResponseStore,
    StoredResponse,
    input_item_objects,
    input_messages,
    list_items,
    output_message,
)
from sluice.server.tool_calls import ArgumentsDelta, ParsedToolCall


def build(events: list[Any], status: str = "completed", max_calls: int | None = None):
    items = OutputItems(max_calls)
    stream = [e for event in events for e in items.add(event)] + items.finish(status)
    return items.items, stream


def replay(stream: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The output items a client rebuilds from the events alone (as the openai client does)."""
    output: list[dict[str, Any]] = []
    for kind, fields in stream:
        if kind == "response.output_item.added":
            assert fields["output_index"] == len(output)
            output.append(fields["item"])
        elif kind == "response.content_part.added":
            output[fields["output_index"]]["content"].append(dict(fields["part"]))
        elif kind == "response.output_text.delta":
            output[fields["output_index"]]["content"][fields["content_index"]]["text"] += fields["delta"]
        elif kind == "response.function_call_arguments.delta":
            output[fields["output_index"]]["arguments"] += fields["delta"]
        elif kind == "response.output_item.done":
            assert fields["item"]["id"] == output[fields["output_index"]]["id"]
            output[fields["output_index"]] = fields["item"]
    return output


def kinds(stream: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [k for k, _ in stream]


def test_text_is_one_message_and_its_deltas() -> None:
    items, stream = build(["Hello", ", ", "world."])
    assert [i["type"] for i in items] == ["message"]
    assert items[0]["content"][0]["text"] == "Hello, world." and items[0]["status"] == "completed"
    assert kinds(stream) == ["response.output_item.added", "response.content_part.added"] + [
        "response.output_text.delta"] * 3 + ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done"]
    assert replay(stream) == items


def test_whitespace_before_a_call_makes_no_message() -> None:
    call = ParsedToolCall("get_weather", '{"city": "Berlin"}')
    items, stream = build(["\n", " ", call, "\n"])
    assert [i["type"] for i in items] == ["function_call"]
    assert items[0]["name"] == "get_weather" and items[0]["arguments"] == '{"city": "Berlin"}'
    assert items[0]["call_id"].startswith("call_") and items[0]["id"].startswith("fc_")
    assert replay(stream) == items
    assert "response.function_call_arguments.done" in kinds(stream)


def test_text_then_calls_then_text_are_separate_items_in_order() -> None:
    a, b = ParsedToolCall("f", "{}"), ParsedToolCall("g", '{"x": 1}')
    items, stream = build(["Let me check.", " ", a, b, "Done", "!"])
    assert [(i["type"], i.get("name")) for i in items] == [
        ("message", None), ("function_call", "f"), ("function_call", "g"), ("message", None)]
    assert items[0]["content"][0]["text"] == "Let me check. "   # the space came while the message was open
    assert items[3]["content"][0]["text"] == "Done!"
    assert all(i["status"] == "completed" for i in items)
    assert replay(stream) == items
    assert len({i["id"] for i in items}) == 4


def test_max_calls_drops_the_calls_past_it() -> None:
    calls = [ParsedToolCall(n, "{}") for n in "fgh"]
    items, _ = build(calls, max_calls=1)
    assert [i["name"] for i in items] == ["f"]


def test_a_named_calls_fragments_stream_into_one_item() -> None:
    items, stream = build([ArgumentsDelta("f", '{"a"'), ArgumentsDelta("f", ': 1'), ArgumentsDelta("f", "}")])
    assert [(i["type"], i["arguments"]) for i in items] == [("function_call", '{"a": 1}')]
    assert kinds(stream).count("response.function_call_arguments.delta") == 3
    assert replay(stream) == items


def test_an_empty_reply_is_an_empty_message_and_a_cut_one_is_incomplete() -> None:
    items, stream = build([])
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [("message", "")]
    assert replay(stream) == items
    items, _ = build(["  "])
    assert items[0]["content"][0]["text"] == "  "
    items, _ = build([ParsedToolCall("f", "{}"), "and then"], status="incomplete")
    assert [i["status"] for i in items] == ["completed", "incomplete"]


def test_input_items_become_chat_messages() -> None:
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"},
    ])
    assert messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items", [
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
    [{"role": "user", "content": None}],
    [{"type": "function_call", "name": "f", "arguments": {}, "call_id": "c"}],
    [{"type": "function_call_output", "output": "x"}],
    [{"type": "reasoning", "content": "not a list of parts"}],
    [{"type": "reasoning", "summary": [{"type": "summary_text"}]}],
    [{"type": "computer_call", "call_id": "c"}],
])
def test_bad_input_items_are_400s(items: list[dict[str, Any]]) -> None:
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status_code == 400 and e.value.param == "input"


def test_reasoning_items_are_their_turns_reasoning() -> None:
    """A reasoning item (an earlier reply's, sent back) is the reasoning of the assistant turn it
    precedes: with its answer, or with its function calls; its text from `content`, else from
    `summary`."""
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Think."}]}
    assert input_messages([
        {"role": "user", "content": "Weather in Paris?"},
        thought,
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sunny, "}, {"type": "summary_text", "text": "say so."}]},
        {"role": "assistant", "content": "Sunny."},
    ]) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "Think.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "assistant", "content": "Sunny.", "reasoning": "Sunny, say so."},
    ]
    listed = input_item_objects([thought])
    assert listed[0]["id"].startswith("rs_") and listed[0]["type"] == "reasoning"
    assert listed[0]["content"] == thought["content"] and listed[0]["summary"] == []


def test_input_items_are_listed_with_ids_and_parts() -> None:
    items = input_item_objects([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "id": "msg_mine", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sun"}]},
    ])
    ids = [item.pop("id") for item in items]
    assert ids[1] == "msg_mine" and len(set(ids)) == 5
    assert ids[0].startswith("msg_") and ids[3].startswith("fc_") and ids[4].startswith("fco_")
    assert items == [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}],
         "status": "completed"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}],
         "status": "completed"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}], "status": "completed"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}',
         "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun", "status": "completed"},
    ]
    [hi] = input_item_objects("hi")
    assert hi["role"] == "user" and hi["content"] == [{"type": "input_text", "text": "hi"}]


def test_input_items_pages() -> None:
    items = [{"id": f"i{k}"} for k in range(5)]

    def ids(**query: Any) -> tuple[list[str], Any, Any, bool]:
        page = list_items(items, **{"after": None, "limit": None, "order": None, "include": None, **query})
        assert page["object"] == "list"
        return [i["id"] for i in page["data"]], page["first_id"], page["last_id"], page["has_more"]

    assert ids() == (["i4", "i3", "i2", "i1", "i0"], "i4", "i0", False)          # newest first
    assert ids(order="asc", limit=2) == (["i0", "i1"], "i0", "i1", True)
    assert ids(order="asc", limit=2, after="i1") == (["i2", "i3"], "i2", "i3", True)
    assert ids(order="asc", limit=2, after="i3") == (["i4"], "i4", "i4", False)
    assert ids(after="i3", limit=3) == (["i2", "i1", "i0"], "i2", "i0", False)
    assert ids(after="i0") == ([], None, None, False)
    assert ids(limit=5) == (["i4", "i3", "i2", "i1", "i0"], "i4", "i0", False)


@pytest.mark.parametrize("query,param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
    ({"after": "nope"}, "after"), ({"include": ["message.output_text.logprobs"]}, "include"),
])
def test_bad_input_items_queries_are_400s(query: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        list_items([{"id": "i0"}], **{"after": None, "limit": None, "order": None, "include": None, **query})
    assert e.value.status_code == 400 and e.value.param == param


def test_output_message_carries_text_and_calls() -> None:
    items, _ = build(["Sure.", ParsedToolCall("f", '{"a": 1}')])
    message = output_message(items)
    assert message == {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": items[1]["call_id"], "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def test_store_is_bounded_least_recently_used_first() -> None:
    store = ResponseStore(2)
    for rid in "abc":
        if rid == "c":
            assert store.get("a") is not None   # a is now more recent than b
        store.put(rid, StoredResponse({"id": rid}, [], None))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, [], None))
    assert empty.get("x") is None
