"""`kiln serve` on bad input: every error in OpenAI's format with the right status and a
message naming the field, an API key, a bounded waiting queue, and good requests that go
on regardless. One server (default model, CPU) for the whole module."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from server_process import ServerProcess, metric, start_server

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
LONG_PROMPT = "word " * 200  # ~200 tokens: with max_tokens 100 it overflows the 256-token context

BAD_SCHEMA_TOOL = {"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
GOOD_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "hi"}]

# (endpoint, body: dict or raw bytes, status, param, words the message must contain)
BAD_REQUESTS: list[tuple[str, Any, int, str | None, str]] = [
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 100}, 400, "prompt", "max_model_len"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 100}, 400,
     "messages", "max_model_len"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ("chat/completions", {"messages": USER, "top_p": 0}, 400, "top_p", "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", "n: must be between"),
    ("chat/completions", {"messages": USER, "n": -3}, 400, "n", "n: must be between"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("completions", {"prompt": []}, 400, "prompt", "empty"),
    ("completions", {"prompt": [10**9]}, 400, "prompt", "vocabulary"),
    # Unknown top-level fields are accepted and logged (as vLLM does); inside messages they are an error.
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "contnet": 1}]}, 400, "messages[0].contnet",
     "unrecognized"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
    ("completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]", "wizard"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id",
     "required"),
    ("chat/completions", {"messages": USER, "tools": [BAD_SCHEMA_TOOL]}, 400, "tools[0].function.parameters",
     "schema"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     400, "tools[0].function.name", "function names"),
    ("chat/completions", {"messages": USER, "tools": [GOOD_TOOL],
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice.function.name", "nope"),
    ("chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", "tools"),
    ("chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type",
     "json_object"),
    ("chat/completions", {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs", "logprobs"),
    ("completions", b'{"prompt": "x", "max_tokens": ', 400, None, "not valid JSON"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    ("completions", b"[1, 2, 3]", 400, None, "JSON object"),
    ("completions", b"", 400, None, "empty"),
    ("chat/completions", b"\xff\xfe not utf-8", 400, None, "not valid JSON"),
    ("completions", {"model": "gpt-17", "prompt": "x"}, 404, "model", "gpt-17"),
    ("chat/completions", {"model": "gpt-17", "messages": USER}, 404, "model", "does not exist"),
]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    srv = start_server("--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY, "--max-num-seqs", "2",
                       "--enable-auto-tool-choice",
                       "--max-waiting-requests", "4", "--served-model-name", "smol")
    yield srv
    srv.stop()


def post(server: ServerProcess, endpoint: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{server.base_url}/{endpoint}", headers=AUTH if headers is None else headers,
                      timeout=120, **kwargs)


def assert_openai_error(r: httpx.Response, status: int, param: str | None, words: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err
    if param is not None:
        # The message names the field (its last part at least).
        assert param.split(".")[-1].split("[")[0] in err["message"], err
    return err


@pytest.mark.parametrize("endpoint,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{b[0]}-{b[3]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request(server: ServerProcess, endpoint: str, body: Any, status: int, param: str | None,
                     words: str) -> None:
    assert_openai_error(post(server, endpoint, body), status, param, words)


def test_api_key(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        err = assert_openai_error(post(server, "completions", {"prompt": "x"}, headers), 401, None, "API key")
        assert err["code"] == "invalid_api_key"
    r = httpx.get(server.base_url + "/models", timeout=30)
    assert r.status_code == 401
    wrong = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401
    right = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    assert [m.id for m in right.models.list().data] == ["smol"]
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_unknown_model_and_path_via_openai_client(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=USER)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    r = httpx.get(server.base_url + "/nothing-here", headers=AUTH)
    assert_openai_error(r, 404, None, "no such endpoint")


def wait_idle(server: ServerProcess, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        if (metric(text, "kiln:num_requests_waiting") == 0 and metric(text, "kiln:num_requests_running") == 0
                and metric(text, "kiln:kv_blocks_in_use") == 0):
            return text
        time.sleep(0.2)
    raise AssertionError(f"server not idle after {timeout}s:\n{text}")


def test_full_waiting_queue_gets_503_with_retry_after(server: ServerProcess) -> None:
    wait_idle(server)
    body = {"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}

    async def run() -> list[tuple[int, dict[str, str], str]]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
            async def one() -> tuple[int, dict[str, str], str]:
                async with http.stream("POST", server.base_url + "/completions", json=body) as r:
                    if r.status_code != 200:
                        return r.status_code, dict(r.headers), (await r.aread()).decode()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # started; close the stream (the request is aborted)
                    return 200, dict(r.headers), ""

            return await asyncio.gather(*(one() for _ in range(12)))

    results = asyncio.run(run())
    statuses = sorted(s for s, _, _ in results)
    assert 200 in statuses and 503 in statuses, statuses
    for status, headers, text in results:
        if status == 503:
            assert int(headers["retry-after"]) >= 1
            err = json.loads(text)["error"]
            assert err["code"] == "queue_full" and "retry" in err["message"]
    # The started ones were aborted when their streams closed: nothing is left behind.
    wait_idle(server)


def test_200_bad_requests_interleaved_with_good_ones(server: ServerProcess) -> None:
    before = wait_idle(server)
    good_n, bad_n = 40, 200

    async def run() -> tuple[list[Any], list[tuple[int, Any, int, str | None]]]:
        sem = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=120) as http, \
                openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120) as client:
            async def good(i: int) -> Any:
                async with sem:
                    if i % 2:
                        return await client.completions.create(model="smol", prompt=f"Item {i}:", max_tokens=3,
                                                               temperature=0, extra_body={"ignore_eos": True})
                    return await client.chat.completions.create(
                        model="smol", messages=[{"role": "user", "content": f"Number {i}?"}], max_tokens=2,
                        temperature=0.7, seed=i, extra_body={"ignore_eos": True})

            async def bad(i: int) -> tuple[int, Any, int, str | None]:
                endpoint, body, status, param, _ = BAD_REQUESTS[i % len(BAD_REQUESTS)]
                headers = {} if i % 17 == 0 else AUTH  # now and then no key at all: 401
                kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                async with sem:
                    r = await http.post(f"{server.base_url}/{endpoint}", headers=headers, **kwargs)
                expected = 401 if i % 17 == 0 else status
                return r.status_code, r.json(), expected, None if i % 17 == 0 else param

            tasks: list[Any] = []
            for i in range(bad_n):
                tasks.append(bad(i))
                if i % (bad_n // good_n) == 0:
                    tasks.append(good(i))
            results = await asyncio.gather(*tasks)
        goods = [r for r in results if not isinstance(r, tuple)]
        bads = [r for r in results if isinstance(r, tuple)]
        return goods, bads

    t0 = time.monotonic()
    goods, bads = asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert len(bads) == bad_n and len(goods) == good_n
    for status, body, expected, param in bads:
        assert status == expected, body
        assert body["error"]["message"] and body["error"]["param"] == param
    for r in goods:
        assert r.usage.completion_tokens in (2, 3)
        choice = r.choices[0]
        assert choice.finish_reason == "length"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    after = wait_idle(server)
    assert metric(after, "kiln:engine_step_failures_total") == metric(before, "kiln:engine_step_failures_total")
    served = sum(metric(after, "kiln:http_requests_total", f'endpoint="{e}",status="200"')
                 for e in ("/v1/completions", "/v1/chat/completions"))
    assert served >= good_n
    assert elapsed < 120, elapsed
