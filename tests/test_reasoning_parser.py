"""Reasoning parsers (`kiln serve --reasoning-parser`): `<think>` tags (qwen3, deepseek_r1) and
GPT-OSS's harmony messages split into reasoning, answer and tool calls, whole and streamed;
a grammar that waits for the end of the reasoning; and the server end to end, through the
official `openai` client, on a tiny model that really writes such replies."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from starlette.testclient import TestClient

from kiln.runtime.guided_decoding import AfterMarker, GrammarCompiler, GrammarMasker, find_token_run
from kiln.runtime.serving.parsers import REASONING_PARSERS, get_reasoning_parser, get_tool_parser
from kiln.runtime.serving.reasoning_parser import ReasoningParser

from runtime_text_model import load_default_tokenizer
from scripted_model import build_scripted_model


def stream(parser: ReasoningParser, text: str, piece: int) -> tuple[str, str, list]:
    """(reasoning, content, call deltas) of `text` fed `piece` characters at a time."""
    reasoning, content, calls = "", "", []
    for i in range(0, len(text), piece):
        d = parser.feed(text[i:i + piece])
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
    d = parser.finish()
    return reasoning + d.reasoning, content + d.content, calls + d.tool_calls


THINK_CASES = [
    # (parser, prompt tail, reply, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nTwo and two.\n</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("qwen3", "<|im_start|>assistant\n", "It is 4.", None, "It is 4."),  # no thinking: all answer
    ("qwen3", "<|im_start|>assistant\n", "  <thin", None, "<thin"),  # looked like a tag, was not
    ("qwen3", "<think>\n\n</think>\n\n", "<think> is a tag.", None, "<think> is a tag."),  # enable_thinking false
    ("qwen3", "assistant\n<think>\n", "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),  # the prompt opened it
    ("qwen3", "<|im_start|>assistant\n", "<think>\nCut off by max_tok", "Cut off by max_tok", None),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Add them.\n</think>\n\n4", "Add them.", "4"),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Add them.</think>4", "Add them.", "4"),  # the model opened it
    ("deepseek_r1", "<｜Assistant｜>", "Still thinking when it stopped", "Still thinking when it stopped", None),
    ("deepseek_r1", "<｜Assistant｜>", "a < b, so </th", "a < b, so </th", None),
    ("deepseek_r1", "<｜Assistant｜>", "x</think>", "x", None),
]


@pytest.mark.parametrize("case", THINK_CASES, ids=lambda c: f"{c[0]}:{c[2][:16]!r}")
@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_think_tags_split_whole_and_streamed(case: tuple, piece: int) -> None:
    name, tail, reply, reasoning, content = case
    cls = get_reasoning_parser(name)
    split = cls(tail).parse(reply)
    assert (split.reasoning, split.content) == (reasoning, content)
    r, c, _ = stream(cls(tail), reply, piece)
    assert (r or None, c or None) == (reasoning, content)


def test_think_tags_stream_as_they_come() -> None:
    """Reasoning is sent as it is written (trailing whitespace held back, since it may be the
    last before `</think>`), not at its end."""
    p = get_reasoning_parser("qwen3")("<|im_start|>assistant\n")
    assert p.feed("<think>\nFirst, ").reasoning == "First,"
    assert p.feed("the sum").reasoning == " the sum"
    d = p.feed(".\n</think>\n\nFo")
    assert (d.reasoning, d.content) == (".", "Fo")


def test_grammar_waits_only_where_the_prompt_leaves_the_reasoning_open() -> None:
    qwen3, r1, harmony = (get_reasoning_parser(n) for n in ("qwen3", "deepseek_r1", "openai_gptoss"))
    assert qwen3.answer_waits_for_marker("<|im_start|>assistant\n")
    assert qwen3.answer_waits_for_marker("assistant\n<think>\n")
    assert not qwen3.answer_waits_for_marker("<think>\n\n</think>\n\n")  # enable_thinking: false
    assert not r1.answer_waits_for_marker("<think>x</think>")
    assert r1.answer_waits_for_marker("<｜Assistant｜><think>\n")
    assert harmony.answer_waits_for_marker("<|start|>assistant")
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "openai_gptoss", "qwen3"]
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'nope'; choose one of deepseek_r1"):
        get_reasoning_parser("nope")


ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. I will call the tool.<|end|>"
HARMONY_CASES = [
    # (reply, tools, reasoning, content, calls)
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>", None,
     "The user wants the weather. I will call the tool.", "It is sunny.", []),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city": "Paris"}<|call|>', {"get_weather"},
     "The user wants the weather. I will call the tool.", None, [("get_weather", {"city": "Paris"})]),
    # the recipient in the role's header; a preamble to the user first (commentary, no recipient)
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>', {"get_weather"},
     None, "Checking.", [("get_weather", {"city": "Oslo"})]),
    # a function the request did not offer: its arguments are text, never a call
    ('<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{"a": 1}<|call|>', {"get_weather"},
     None, '{"a": 1}', []),
    # the model's built-in tools (browser, python) are part of its reasoning
    ("<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>", None,
     '{"query": "x"}', None, []),
    ("Plain text from a model that does not speak harmony.", None, None,
     "Plain text from a model that does not speak harmony.", []),
    (ANALYSIS + "<|start|>assistant<|channel|>fin", None,  # cut off in a header
     "The user wants the weather. I will call the tool.", None, []),
]


@pytest.mark.parametrize("case", HARMONY_CASES, ids=range(len(HARMONY_CASES)))
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_harmony_messages_split_whole_and_streamed(case: tuple, piece: int) -> None:
    reply, tools, reasoning, content, calls = case
    cls = get_reasoning_parser("openai_gptoss")
    split = cls("", tools).parse(reply)
    assert (split.reasoning, split.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in split.tool_calls] == calls
    r, c, deltas = stream(cls("", tools), reply, piece)
    assert (r or None, c or None) == (reasoning, content)
    names = [d.name for d in deltas if d.name is not None]
    assert names == [name for name, _ in calls]
    if calls:  # (one call a reply here)
        assert json.loads("".join(d.arguments for d in deltas)) == calls[0][1]
    # --tool-call-parser openai alone: the same calls, the analysis left out of the content
    parsed = get_tool_parser("openai")(tools).parse(reply)
    assert (parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]) == (content, calls)


# ---- a grammar after the reasoning ------------------------------------------------------------
class _Seq:
    def __init__(self, output: list[int]):
        self.request_id, self.index, self.output_token_ids = "r", 0, output


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def test_grammar_masks_only_after_the_marker(tokenizer) -> None:
    """The rows of a request whose grammar waits for `</think>` are left alone while it
    thinks (whatever it writes), then follow the grammar from the token after the marker."""
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    grammar = compiler.json({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "x")
    marker = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    masker = GrammarMasker(vocab, [tokenizer.eos_token_id])
    masker.register("r", AfterMarker(grammar, marker))
    thinking = tokenizer.encode("<think>Not JSON at all, and a </thin", add_special_tokens=False)
    seq = _Seq(list(thinking))
    for n in range(1, len(thinking) + 1):  # step by step: the scan resumes where it stopped
        seq.output_token_ids = thinking[:n]
        logits = torch.zeros(1, vocab)
        masker.apply(logits, [seq])
        assert torch.isfinite(logits).all()
    seq.output_token_ids = thinking + list(marker)
    logits = torch.zeros(1, vocab)
    masker.apply(logits, [seq])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < vocab // 10
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    # and after `{"a": 1}` the grammar has consumed exactly the answer's tokens
    answer = tokenizer.encode('{"a": 1}', add_special_tokens=False)
    seq.output_token_ids = thinking + list(marker) + answer
    logits = torch.zeros(1, vocab)
    masker.apply(logits, [seq])
    assert torch.isfinite(logits[0, tokenizer.eos_token_id]) and torch.isinf(logits[0]).sum() == vocab - 1


def test_find_token_run() -> None:
    assert find_token_run([1, 2, 3, 2, 3], (2, 3)) == 1
    assert find_token_run([1, 2], (2, 3)) == -1
    with pytest.raises(ValueError):
        AfterMarker(None, ())


# ---- the server, end to end -----------------------------------------------------------------
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
THINK_PROMPT = "Add two and two"
THINK_REPLY = '<think>Adding gives four</think>{"answer": 4}'
TOOL_PROMPT = "Weather in Paris"
# (no space before <|constrain|>, unlike GPT-OSS: this model's next token depends on the
# current one alone, and the JSON answer above has a space followed by another token)
TOOL_REPLY = "<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{ \"city\":\"Paris\"}<|call|>"
# The prompt is the messages' text alone, so its last token picks the reply.
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine

    # As in Qwen3's and GPT-OSS's vocabularies: the think tags are added (not special) tokens,
    # harmony's markers special ones.
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    starts = [tokenizer.encode(p, add_special_tokens=False)[-1] for p in (THINK_PROMPT, TOOL_PROMPT)]
    path = build_scripted_model(tmp_path_factory.mktemp("scripted"), tokenizer, starts, [THINK_REPLY, TOOL_REPLY])
    return LLMEngine(EngineConfig(model=str(path), max_model_len=256, num_kv_blocks=32, progress=False, seed=0))


def serve(engine, **options):
    from kiln.runtime.serving.app import ServerConfig, build_app

    app = build_app(engine, ServerConfig(served_model_names=["m"], chat_template=TEMPLATE, **options))
    return TestClient(app)


def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def ask(c: openai.OpenAI, prompt: str, **kw):
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=40,
                                     temperature=0, **kw)


def test_scripted_model_writes_its_replies(engine) -> None:
    """Without a reasoning parser the reply is all content, exactly the script."""
    with serve(engine) as http:
        assert ask(client(http), THINK_PROMPT).choices[0].message.content == THINK_REPLY


def test_reasoning_content_whole_streamed_and_left_out(engine) -> None:
    with serve(engine, reasoning_parser="qwen3") as http:
        c = client(http)
        msg = ask(c, THINK_PROMPT).choices[0].message
        assert msg.reasoning_content == "Adding gives four" and msg.content == '{"answer": 4}'
        assert msg.model_extra["reasoning"] == msg.reasoning_content  # vLLM's newer name too
        reasoning, content, finish = "", "", None
        for chunk in ask(c, THINK_PROMPT, stream=True):
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (reasoning, content, finish) == ("Adding gives four", '{"answer": 4}', "stop")
        left_out = ask(c, THINK_PROMPT, extra_body={"include_reasoning": False}).choices[0].message
        assert left_out.reasoning_content is None and left_out.content == '{"answer": 4}'


def test_response_format_constrains_the_answer_not_the_reasoning(engine) -> None:
    """With the parser the JSON grammar waits for `</think>`: the model thinks, then answers
    within the schema. Without it the grammar holds from the first token: no thinking."""
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
    with serve(engine, reasoning_parser="qwen3") as http:
        msg = ask(client(http), THINK_PROMPT, response_format=schema).choices[0].message
        assert msg.reasoning_content == "Adding gives four" and json.loads(msg.content) == {"answer": 4}
    with serve(engine) as http:
        text = ask(client(http), THINK_PROMPT, response_format=schema).choices[0].message.content
        assert "<think>" not in text and isinstance(json.loads(text)["answer"], int)


def test_harmony_tool_call_through_the_server(engine) -> None:
    """GPT-OSS's harmony call (special tokens kept in the text for the parser), whole and
    streamed, with `--reasoning-parser openai_gptoss` and with `--tool-call-parser openai` alone;
    tool_choice required and named through harmony's grammar."""
    for options in ({"reasoning_parser": "openai_gptoss"}, {"tool_call_parser": "openai"}):
        with serve(engine, enable_auto_tool_choice=True, **options) as http:
            c = client(http)
            choice = ask(c, TOOL_PROMPT, tools=[WEATHER_TOOL]).choices[0]
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
            args, names, finish = "", [], None
            for chunk in ask(c, TOOL_PROMPT, tools=[WEATHER_TOOL], stream=True):
                for d in chunk.choices[0].delta.tool_calls or []:
                    names += [d.function.name] if d.function.name else []
                    args += d.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"} and finish == "tool_calls"
            # tool_choice required / named: xgrammar's harmony tag (its analysis channel allowed)
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                forced = ask(c, TOOL_PROMPT, tools=[WEATHER_TOOL], tool_choice=choice).choices[0]
                assert forced.finish_reason == "tool_calls"
                assert json.loads(forced.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_earlier_reasoning_reaches_the_template(engine) -> None:
    """An assistant message's reasoning (as this server returns it) is given to the template
    under the names Qwen3's and GPT-OSS's templates read."""
    from kiln.runtime.serving.chat_prompt import template_inputs, to_template_messages
    from kiln.runtime.serving.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"}], "reasoning_effort": "low"})
    msgs = to_template_messages(req, native_tools=True)
    assert msgs[1]["reasoning_content"] == msgs[1]["thinking"] == "Greet back."
    assert "thinking" not in msgs[0] and "thinking" not in msgs[2]
    assert template_inputs(TEMPLATE, req, None).variables == {"reasoning_effort": "low"}  # GPT-OSS's template reads it
