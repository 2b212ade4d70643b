"""Tool-call parsers per model family (hermes, llama3_json, mistral, qwen3_coder, openai), on the
formats models really write; streamed calls arrive as a name, then argument fragments."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kiln.runtime.serving.parsers import TOOL_PARSERS, get_tool_parser
from kiln.runtime.serving.tool_parser import HermesToolParser, ToolParser, parse_tool_calls

StreamingToolParser = HermesToolParser

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


@dataclass
class Assembled:
    name: str
    arguments: str  # the fragments, concatenated
    id: str
    num_fragments: int


def stream(parser: ToolParser, text: str, piece: int) -> tuple[str, list[Assembled]]:
    """Feed `text` in pieces; content and the calls assembled from their deltas, checking
    that each call's first delta has its id and name and the later ones only arguments."""
    content, calls = "", {}
    deltas = []
    for i in range(0, len(text), piece):
        d = parser.feed(text[i:i + piece])
        content += d.content
        deltas += d.tool_calls
    d = parser.finish()
    content += d.content
    deltas += d.tool_calls
    for delta in deltas:
        if delta.index not in calls:
            assert delta.id and delta.name and delta.arguments == "", delta
            calls[delta.index] = Assembled(delta.name, "", delta.id, 0)
        else:
            assert delta.id is None and delta.name is None
            calls[delta.index].arguments += delta.arguments
            calls[delta.index].num_fragments += 1
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def _stream(text: str, piece: int, names: set[str] | None = None) -> tuple[str, list]:
    return stream(HermesToolParser(names), text, piece)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [TWO_CALLS, NESTED])
def test_streaming_matches_whole_text(piece: int, text: str) -> None:
    content, calls = _stream(text, piece)
    whole = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, json.loads(c.arguments))
                                                                  for c in whole.tool_calls]
    if piece < 5:  # arguments arrive in fragments as they are written, not in one piece
        assert all(c.num_fragments > 3 for c in calls)
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


# ---- the other families ---------------------------------------------------------------------
WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                              "metric": {"type": "boolean"}}}}
FAMILIES = {
    # family: (reply text, expected [(name, arguments)], expected content)
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                    [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})], None),
    "llama3_json_tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
                        [("get_weather", {"city": "Rome"})], None),
    "mistral": ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}]',
                [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lima", "days": 2})], "Let me look."),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Kyiv"}',
                    [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Kyiv"})], None),
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                    "<parameter=days>\n5\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
                    "</tool_call>",
                    [("get_weather", {"city": "New York", "days": 5, "metric": True})], "Checking."),
    # GPT-OSS (harmony): its analysis is not content; more in tests/test_reasoning_parser.py
    "openai": ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>',
               [("get_weather", {"city": "Paris", "days": 3})], None),
}


@pytest.mark.parametrize("case", sorted(FAMILIES))
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_family_parse_and_stream(case: str, piece: int) -> None:
    text, want, content = FAMILIES[case]
    parser_cls = get_tool_parser(case.replace("_tag", "").replace("_v11", ""))
    whole = parser_cls(WEATHER).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == want
    assert whole.content == content
    streamed, calls = stream(parser_cls(WEATHER), text, piece)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert (streamed.strip() or None) == content
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
def test_plain_replies_and_unknown_functions_stay_content(family: str) -> None:
    parser = get_tool_parser(family)
    for text in ("The weather is fine.", '{"answer": 42}'):
        assert parser(WEATHER).parse(text).tool_calls == []
        content, calls = stream(parser(WEATHER), text, 2)
        assert calls == [] and content == text
    unknown = {"hermes": '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
               "llama3_json": '{"name": "nope", "parameters": {}}',
               "mistral": '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
               "qwen3_coder": "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
               "openai": "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>"}[family]
    parsed = parser(WEATHER).parse(unknown)
    # (harmony's content is a message's text, never its markers)
    assert parsed.tool_calls == [] and parsed.content == ("{}" if family == "openai" else unknown)


def test_qwen3_coder_values_follow_the_schema() -> None:
    """A string parameter stays a string even when it looks like a number."""
    schema = {"f": {"type": "object", "properties": {"zip": {"type": "string"}, "n": {"type": "number"}}}}
    text = "<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n" \
           "</function>\n</tool_call>"
    (call,) = get_tool_parser("qwen3_coder")(schema).parse(text).tool_calls
    assert json.loads(call.arguments) == {"zip": "01234", "n": 2.5}


def test_unknown_parser_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown parser 'nope'; choose one of hermes, llama3_json, mistral, "
                                         "openai, qwen3_coder"):
        get_tool_parser("nope")


GRAMMAR_EXAMPLES = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>",
    # (harmony's markers are plain text to this tokenizer; tests/test_reasoning_parser.py runs
    # them as the special tokens they are)
    "openai": '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
}


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    from transformers import AutoTokenizer

    from kiln.runtime.guided_decoding import GrammarCompiler
    from runtime_text_model import text_model_dir

    tok = AutoTokenizer.from_pretrained(str(text_model_dir(tmp_path_factory)))
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


@pytest.mark.parametrize("family", sorted(GRAMMAR_EXAMPLES))
def test_grammar_and_parser_agree_per_family(family: str, grammars) -> None:
    """What the family's tool_choice grammar lets through, its parser reads back as the call;
    a call of an unknown function is not let through."""
    import xgrammar as xgr

    from kiln.runtime.guided_decoding import ToolSchema

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [ToolSchema("get_weather", schema, "tools[0]")]
    text = GRAMMAR_EXAMPLES[family]
    for mode in ("named", "required", "auto"):
        matcher = xgr.GrammarMatcher(grammars.tool_calls(tools, mode, True, family))
        assert matcher.accept_string(text), (family, mode)
        assert not xgr.GrammarMatcher(grammars.tool_calls(tools, mode, True, family)).accept_string(
            text.replace("get_weather", "get_wether")), (family, mode)
    (call,) = get_tool_parser(family)({"get_weather": schema}).parse(text).tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("family,marker", [("hermes", "<tool_call>\n{"), ("llama3_json", '"parameters"'),
                                           ("mistral", "[TOOL_CALLS]["), ("qwen3_coder", "<function=")])
def test_templates_without_tools_ask_for_the_parsers_format(family: str, marker: str) -> None:
    """A chat template that knows nothing of tools gets them in a system message, which asks
    for the call format the server's parser reads back."""
    from kiln.runtime.serving.chat_prompt import _with_tools_system_prompt

    (system,) = _with_tools_system_prompt([], [WEATHER_TOOL_DEF], family)
    assert system["role"] == "system" and marker in system["content"] and "get_weather" in system["content"]


WEATHER_TOOL_DEF = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["get_weather"]}}
