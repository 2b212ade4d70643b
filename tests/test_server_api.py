"""`kiln serve` end to end: the default model on CPU behind real HTTP, driven by the official
`openai` client. One server for the whole module (engine start-up is the slow part)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from server_process import ServerProcess, metric, start_server

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    srv = start_server("--max-model-len", "1024", "--served-model-name", "smol", "--enable-auto-tool-choice")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tokenizer():
    from kiln.compiler.model_source import resolve_model

    return resolve_model(None).tokenizer()


def metrics_text(server: ServerProcess) -> str:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def test_models_health_and_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    assert client.models.retrieve("smol").id == "smol"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = metrics_text(server)
    for name in ("kiln:num_requests_waiting", "kiln:num_requests_running", "kiln:kv_blocks_in_use",
                 "kiln:kv_blocks_total", "kiln:prefix_cache_hit_rate"):
        metric(text, name)
    assert metric(text, "kiln:kv_blocks_total") > 0
    assert "kiln:time_to_first_token_seconds" in text and "kiln:time_per_output_token_seconds" in text


def test_completion_usage_and_logprobs_match_tokenizer(client: openai.OpenAI, tokenizer) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert len(top) <= 2
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert token in top


def test_completion_prompt_forms(client: openai.OpenAI, tokenizer) -> None:
    ids = tokenizer("Once upon a time")["input_ids"]
    by_text = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=4, temperature=0)
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model="smol", prompt=["Once upon a time", "The sky is"], max_tokens=4,
                                      temperature=0, echo=True)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == "Once upon a time" + by_text.choices[0].text
    assert batch.choices[1].text.startswith("The sky is")
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer("The sky is")["input_ids"])


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, tokenizer) -> None:
    """echo with logprobs, as lm-evaluation-harness scores a continuation through the API
    (token ids, echo, logprobs, max_tokens 1; or 0, the prompt alone): logprobs for every
    prompt token but the first (None), then the completion's; a drawn token echoed back as a
    prompt token scores what it scored when drawn (teacher forcing); streamed or not alike."""
    ids = tokenizer("The capital of France is")["input_ids"]
    plain = client.completions.create(model="smol", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    drawn = plain.choices[0].logprobs.token_logprobs
    r = client.completions.create(model="smol", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[len(ids):] == pytest.approx(drawn, abs=1e-5)
    assert r.choices[0].text == "The capital of France is" + plain.choices[0].text
    # The drawn tokens echoed back as prompt tokens (max_tokens 0: the prompt alone, scored).
    drawn_ids = tokenizer(plain.choices[0].text, add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([t]) for t in drawn_ids] == plain.choices[0].logprobs.tokens  # (the same tokens)
    scored = client.completions.create(model="smol", prompt=ids + drawn_ids, max_tokens=0, temperature=0,
                                       logprobs=1, echo=True)
    (choice,) = scored.choices
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert choice.text == "The capital of France is" + plain.choices[0].text
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # Streamed: the prompt's logprobs come with the first chunk.
    chunks = list(client.completions.create(model="smol", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smol", prompt=ids, max_tokens=0)  # without echo: nothing to return


def test_truncate_prompt_tokens(client: openai.OpenAI, tokenizer) -> None:
    """vLLM's `truncate_prompt_tokens` extra field: the prompt's last k tokens run (echoed as
    such), on both endpoints; a prompt over max_model_len (1,024 here) runs once cut."""
    ids = tokenizer("Once upon a time there was a")["input_ids"]
    cut = client.completions.create(model="smol", prompt=ids, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3})
    alone = client.completions.create(model="smol", prompt=ids[-3:], max_tokens=4, temperature=0, echo=True)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == alone.choices[0].text
    assert cut.choices[0].text.startswith(tokenizer.decode(ids[-3:]))
    long = (ids * 200)[:1100]
    r = client.completions.create(model="smol", prompt=long, max_tokens=2, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 1000})
    assert r.usage.prompt_tokens == 1000
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi " * 50}],
                                          max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": 10})
    assert chat.usage.prompt_tokens == 10
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="smol", prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})


def test_chat_usage_matches_chat_template(client: openai.OpenAI, tokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=0)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert r.usage.prompt_tokens == len(expected)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert 1 <= r.usage.completion_tokens <= 6
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 6


def test_streaming_chat_deltas_equal_non_streamed_text(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert roles == ["assistant"]
    assert len(pieces) > 1  # really streamed, not one blob
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_completion_with_n2(client: openai.OpenAI) -> None:
    kwargs = dict(model="smol", prompt="My favourite food is", max_tokens=10, temperature=0.9, seed=7, n=2,
                  logprobs=0)
    whole = client.completions.create(**kwargs)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    # A seed makes sampling reproducible, per completion index.
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_n2_seeded_sampling(client: openai.OpenAI) -> None:
    kwargs = dict(model="smol", messages=[{"role": "user", "content": "Tell me a fun fact."}], max_tokens=12,
                  temperature=1.0, seed=1234, n=2)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert a.usage.completion_tokens >= 2  # both completions counted


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "List three animals: cat, dog,"
    base = client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # A stop string taken from the middle of the greedy output.
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = base[: base.index(stop)]
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\u2603"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    pieces = [c.text for ch in client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0,
                                                          stop=stop, stream=True, extra_body={"ignore_eos": True})
              for c in ch.choices]
    assert "".join(pieces) == cut


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    (choice,) = r.choices
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(values[0], abs=1e-4)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    if choice.finish_reason == "length":
        assert "".join(e.token for e in content) == choice.message.content


def test_tool_call_named_function(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smol", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and args["city"]
    assert set(args) <= {"city"}  # the schema allows nothing else


def test_tool_call_required_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smol", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=48,
        tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or tc.id
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                finish = c.finish_reason
    assert finish == "tool_calls"
    assert content == ""
    assert list(calls) == [0]
    assert calls[0]["id"] and calls[0]["name"] in {"get_weather", "get_time"}
    args = json.loads(calls[0]["arguments"])
    assert isinstance(args, dict)


def test_tool_choice_none_and_auto_never_fail(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(model="smol", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                          tool_choice="none", temperature=0, max_tokens=8)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model="smol", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                          temperature=0, max_tokens=8)
    msg = auto.choices[0].message
    # Whatever the model chose, the answer is well formed: text, or calls that parse.
    if msg.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        assert all(isinstance(json.loads(tc.function.arguments), dict) for tc in msg.tool_calls)
    else:
        assert msg.content is not None


def test_tool_conversation_round_trip(client: openai.OpenAI) -> None:
    messages = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.content


def test_json_response_format(client: openai.OpenAI) -> None:
    # maxLength keeps the whole object well inside max_tokens, so it must complete.
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}},
              "required": ["answer"]}
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content, strict=False)
    assert list(value) == ["answer"] and isinstance(value["answer"], str) and len(value["answer"]) <= 24


def test_concurrent_requests_share_engine_steps(server: ServerProcess) -> None:
    before = metric(metrics_text(server), "kiln:engine_steps_total")

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=180) as c:
            return await asyncio.gather(*(
                c.completions.create(model="smol", prompt=f"Story number {i}:", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}) for i in range(4)))

    results = asyncio.run(run())
    assert all(r.usage.completion_tokens == 12 for r in results)
    steps = metric(metrics_text(server), "kiln:engine_steps_total") - before
    # Run one after another they would need >= 4 x 12 steps; batched, about 12.
    assert steps <= 2 * 12, steps


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_disconnect_mid_stream_frees_kv_blocks(server: ServerProcess) -> None:
    assert _wait_for(lambda: metric(metrics_text(server), "kiln:kv_blocks_in_use") == 0)
    aborted_before = metric(metrics_text(server), "kiln:requests_aborted_total")
    body = {"model": "smol", "prompt": "Count slowly: one, two,", "max_tokens": 600, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.base_url + "/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
            text = metrics_text(server)
            assert metric(text, "kiln:kv_blocks_in_use") > 0
            assert metric(text, "kiln:num_requests_running") == 1
        # Leaving the `with` closes the connection mid-stream.
    assert _wait_for(lambda: metric(metrics_text(server), "kiln:kv_blocks_in_use") == 0, 60), metrics_text(server)
    text = metrics_text(server)
    assert metric(text, "kiln:num_requests_running") == 0
    assert metric(text, "kiln:requests_aborted_total") == aborted_before + 1


def test_disconnect_while_waiting_for_non_streamed_reply(server: ServerProcess) -> None:
    aborted_before = metric(metrics_text(server), "kiln:requests_aborted_total")
    body = {"model": "smol", "prompt": "Count slowly: one, two,", "max_tokens": 600, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(60, read=3))
    assert _wait_for(lambda: metric(metrics_text(server), "kiln:requests_aborted_total") == aborted_before + 1, 60)
    assert _wait_for(lambda: metric(metrics_text(server), "kiln:kv_blocks_in_use") == 0, 60)


def test_zz_sigterm_finishes_in_flight_request_then_exits(server: ServerProcess) -> None:
    """Runs last in this module (it stops the module's server)."""
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish, done = "", None, False
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.base_url + "/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if not text and not finish:
                    server.proc.send_signal(15)  # SIGTERM after the first chunk
                for c in chunk["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
    assert done and finish == "length"
    assert server.proc.wait(60) == 0, server.log_tail()
