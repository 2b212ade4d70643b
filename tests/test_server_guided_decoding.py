"""Guided decoding for tool calls and JSON, with the default model's real tokenizer and the
real sampler, but random logits: whatever the model "wants", the output must parse."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.runtime.guided_decoding import GrammarCompiler, GrammarError, GrammarMasker, ToolSchema
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence
from kiln.runtime.serving.tool_parser import parse_tool_calls

WEATHER = ToolSchema("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]},
    "tools[0].function.parameters")
TIME = ToolSchema("get_time", {"type": "object", "properties": {"offset": {"type": "integer"}},
                                "required": ["offset"]}, "tools[1].function.parameters")


@pytest.fixture(scope="module")
def tokenizer():
    from kiln.compiler.model_source import resolve_model

    return resolve_model(None).tokenizer()


@pytest.fixture(scope="module")
def setup(tokenizer):
    vocab = 49152
    eos = [tokenizer.eos_token_id]
    return GrammarCompiler(tokenizer, vocab, eos), vocab, eos


def generate(setup, compiled, seed: int, n: int = 1, max_tokens: int = 120, temperature: float = 0.0) -> list[str]:
    """Sample (greedy: the random logits are the randomness) through the engine's logits
    processor (GrammarMasker) and Sampler until EOS; the decoded texts."""
    grammars, vocab, eos = setup
    masker, sampler = GrammarMasker(vocab, eos), Sampler(eos)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, n=n)
    seqs = [Sequence(seq_id=i, request_id="r", prompt_token_ids=[1], params=params, index=i) for i in range(n)]
    masker.register("r", compiled)
    gen = torch.Generator().manual_seed(seed)
    live = list(seqs)
    for _ in range(max_tokens):
        if not live:
            break
        # Spiky random logits: a different "favourite" token at every step.
        logits = torch.randn(len(live), vocab, generator=gen) * 4
        masker.apply(logits, live)
        out = sampler.sample(logits, live)
        for seq, token in zip(list(live), out.token_ids):
            if token in eos:
                live.remove(seq)
            else:
                seq.output_token_ids.append(token)
    assert not live, "the grammar never let the sequence end"
    masker.release("r")
    return [grammars._tokenizer.decode(s.output_token_ids) for s in seqs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_tool_call_always_parses(setup, seed: int) -> None:
    compiled = setup[0].tool_calls([WEATHER], "named")
    (text,) = generate(setup, compiled, seed)
    parsed = parse_tool_calls(text, {"get_weather"})
    assert parsed.content is None, text
    (call,) = parsed.tool_calls
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and len(args["city"]) <= 12


def test_required_picks_one_of_the_tools_per_completion(setup) -> None:
    compiled = setup[0].tool_calls([WEATHER, TIME], "required")
    texts = generate(setup, compiled, seed=5, n=3)
    for text in texts:
        (call,) = parse_tool_calls(text, {"get_weather", "get_time"}).tool_calls
        args = json.loads(call.arguments)
        if call.name == "get_time":
            assert isinstance(args["offset"], int)
        else:
            assert set(args) == {"city", "unit"}


def test_json_schema_and_json_object(setup) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"]}
    (text,) = generate(setup, setup[0].json(schema, "response_format"), seed=3)
    value = json.loads(text)
    assert isinstance(value["ok"], bool) and isinstance(value["n"], int)
    assert setup[0].json(None, "response_format") is not None  # any JSON: compiles (random logits may not end)


def test_unguided_rows_are_untouched(setup) -> None:
    grammars, vocab, eos = setup
    masker, sampler = GrammarMasker(vocab, eos), Sampler(eos)
    params = SamplingParams(max_tokens=5, temperature=0)
    guided = Sequence(seq_id=0, request_id="g", prompt_token_ids=[1], params=params)
    free = Sequence(seq_id=1, request_id="f", prompt_token_ids=[1], params=params)
    masker.register("g", grammars.tool_calls([WEATHER], "named"))
    logits = torch.zeros(2, vocab)
    logits[:, 42] = 10.0  # both rows want token 42
    masker.apply(logits, [guided, free])
    out = sampler.sample(logits, [guided, free])
    assert out.token_ids[1] == 42
    assert out.token_ids[0] != 42  # "<tool_call>" must come first
    assert grammars._tokenizer.decode([out.token_ids[0]]).startswith("<")


@pytest.mark.parametrize("schema,param", [
    ({"type": "object", "properties": {"x": {"type": "no-such-type"}}}, "tools[0].function.parameters"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "tools[0].function.parameters"),
    ("not a schema", "tools[0].function.parameters"),
])
def test_bad_schema_is_a_grammar_error_naming_the_field(setup, schema, param: str) -> None:
    with pytest.raises(GrammarError) as e:
        setup[0].tool_calls([ToolSchema("f", schema, param)], "auto")
    assert e.value.param == param and param in str(e.value)
