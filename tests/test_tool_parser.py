"""The Hermes/Qwen `<tool_call>` parser, on the formats models really write."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.serving.tool_parser import StreamingToolParser, parse_tool_calls

ONE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO_CALLS = (
    "I'll check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
)
NESTED = ('<tool_call>\n{"name": "create_event", "arguments": {"title": "Launch", "when": {"start": '
          '"2025-01-01T10:00", "end": null}, "attendees": [{"name": "Ana", "tags": ["a", "b"]}], '
          '"notes": "braces } and tags </tool_call> inside strings"}}\n</tool_call>')


def test_one_call() -> None:
    parsed = parse_tool_calls(ONE_CALL)
    assert parsed.content is None
    assert len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    openai = call.to_openai()
    assert openai["type"] == "function" and openai["id"].startswith("call_")
    assert openai["function"] == {"name": "get_weather", "arguments": call.arguments}


def test_several_calls_and_content() -> None:
    parsed = parse_tool_calls(TWO_CALLS)
    assert parsed.content == "I'll check both cities."
    assert [json.loads(c.arguments)["city"] for c in parsed.tool_calls] == ["Paris", "Tokyo"]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_nested_arguments() -> None:
    # Nested objects and arrays, escapes, and the closing tag itself inside a JSON string:
    # the block ends at the first `</tool_call>` outside any string.
    parsed = parse_tool_calls(NESTED)
    assert parsed.content is None
    args = json.loads(parsed.tool_calls[0].arguments)
    assert args["when"] == {"start": "2025-01-01T10:00", "end": None}
    assert args["attendees"][0]["tags"] == ["a", "b"]
    assert args["notes"] == "braces } and tags </tool_call> inside strings"
    escaped = '<tool_call>{"name": "f", "arguments": {"q": "say \\"</tool_call>\\" now"}}</tool_call>tail'
    parsed = parse_tool_calls(escaped)
    assert json.loads(parsed.tool_calls[0].arguments) == {"q": 'say "</tool_call>" now'}
    assert parsed.content == "tail"


def test_arguments_as_json_string_and_parameters_key() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert json.loads(parse_tool_calls(text).tool_calls[0].arguments) == {"x": 1}
    text = '<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}</tool_call>'
    assert json.loads(parse_tool_calls(text).tool_calls[0].arguments) == {"x": [1, 2]}


def test_unclosed_last_call_with_complete_json_counts() -> None:
    parsed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n')
    assert [c.name for c in parsed.tool_calls] == ["f"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    "<tool_call>not json</tool_call>",
    '<tool_call>["get_weather"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    ONE_CALL + '\n<tool_call>{"name": }</tool_call>',  # one good, one bad: all content
])
def test_malformed_output_is_plain_content(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == []
    assert parsed.content == text


def test_unknown_function_is_content_when_names_given() -> None:
    assert parse_tool_calls(ONE_CALL, allowed_names={"get_weather"}).tool_calls
    parsed = parse_tool_calls(ONE_CALL, allowed_names={"get_time"})
    assert parsed.tool_calls == [] and parsed.content == ONE_CALL


def test_text_without_calls_is_untouched() -> None:
    text = "The weather in Paris is sunny. <tool is a word> {not a call}"
    parsed = parse_tool_calls(text)
    assert parsed.content == text and parsed.tool_calls == []


def _stream(text: str, piece: int, names: set[str] | None = None) -> tuple[str, list]:
    parser = StreamingToolParser(names)
    content, calls = "", []
    for i in range(0, len(text), piece):
        d = parser.feed(text[i:i + piece])
        content += d.content
        calls += d.tool_calls
    d = parser.finish()
    return content + d.content, calls + d.tool_calls


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [TWO_CALLS, NESTED])
def test_streaming_matches_whole_text(piece: int, text: str) -> None:
    content, calls = _stream(text, piece)
    whole = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (content.strip() or None) == whole.content


@pytest.mark.parametrize("piece", [1, 4])
def test_streaming_never_leaks_a_partial_tag(piece: int) -> None:
    parser = StreamingToolParser()
    seen = ""
    for i in range(0, len(ONE_CALL), piece):
        seen += parser.feed(ONE_CALL[i:i + piece]).content
        assert "<" not in seen  # "<tool_call>" is held back until it is known to be one
    assert seen == ""


@pytest.mark.parametrize("piece", [1, 5])
def test_streaming_malformed_block_becomes_content(piece: int) -> None:
    text = 'Sure. <tool_call>{"name": oops}</tool_call> done'
    content, calls = _stream(text, piece)
    assert calls == [] and content == text


def test_streaming_unclosed_block_at_end() -> None:
    content, calls = _stream('<tool_call>{"name": "f", "arguments": {"a": 1}}', 3)
    assert [c.name for c in calls] == ["f"] and content == ""
    content, calls = _stream('<tool_call>{"name": "f", "argu', 3)
    assert calls == [] and content == '<tool_call>{"name": "f", "argu'


def test_streaming_text_that_only_looks_like_a_tag_start() -> None:
    content, calls = _stream("a < b and <tool is not <tool_call", 2)
    assert calls == [] and content == "a < b and <tool is not <tool_call"
