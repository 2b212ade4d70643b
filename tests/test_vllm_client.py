"""The server as a vLLM user drives it, through the official `openai` client.

Most tests run the app in-process (the openai client over Starlette's TestClient, which is
an httpx client: real ASGI app, real request parsing) on the tiny text model; one runs a
real `kiln serve --model HUB_ID ...` subprocess (uvicorn, hub id from a hand-made HF cache,
the vLLM flags) and a vLLM-style client script against it, unchanged but for its URL.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import openai
import pytest
from starlette.testclient import TestClient

from kiln.runtime import __version__
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.serving.app import ServerConfig, build_app
from kiln.runtime.serving.metrics import VLLM_NAMES, StatsLogger

from hub_cache import add_to_hub_cache
from runtime_text_model import text_model_dir
from server_process import metric, start_server

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    # maxLength: the tiny random model would otherwise fill max_tokens inside the string.
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(text_model_dir(tmp_path_factory)), max_model_len=512,
                                  num_kv_blocks=64, progress=False, seed=0))


@pytest.fixture(scope="module")
def app_client(engine):
    """(openai client, TestClient) of an app with the vLLM options set."""
    app = build_app(engine, ServerConfig(served_model_names=["tiny"], tool_call_parser="llama3_json",
                                         enable_auto_tool_choice=True))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), http


@pytest.fixture(scope="module")
def client(app_client) -> openai.OpenAI:
    return app_client[0]


@pytest.fixture(scope="module")
def http(app_client) -> TestClient:
    return app_client[1]


def test_unknown_fields_are_accepted_and_logged_once(client, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kiln.serving")
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0,
                                      extra_body={"reasoning_effort": "low", "kiln_made_up_field": 1,
                                                  "functions": [{"name": "f"}]})
        assert r.choices[0].text is not None
    lines = [rec.getMessage() for rec in caplog.records if "kiln_made_up_field" in rec.getMessage()]
    assert len(lines) == 1 and "ignored" in lines[0]


def test_vllm_sampling_fields_are_honoured(client) -> None:
    base = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    greedy = client.completions.create(**base).choices[0].text
    assert client.completions.create(**{**base, "temperature": 1.0},
                                     extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0}
                                     ).choices[0].text == greedy  # top_k 1 is greedy
    regex = client.completions.create(**base, extra_body={"guided_regex": "[0-9]{3}"}).choices[0].text
    assert re.fullmatch("[0-9]{3}", regex)
    choice = client.completions.create(**base, extra_body={"guided_choice": ["yes", "no"]}).choices[0].text
    assert choice in ("yes", "no")
    so = client.completions.create(**{**base, "max_tokens": 40}, extra_body={
        "structured_outputs": {"json": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                        "required": ["a"], "additionalProperties": False}}}).choices[0].text
    assert json.loads(so)["a"] in ("x", "y")
    chat_json = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give JSON"}], max_tokens=40, temperature=0,
        extra_body={"guided_json": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}})
    assert isinstance(json.loads(chat_json.choices[0].message.content)["b"], bool)
    stop = greedy[2:4]
    kept = client.completions.create(**base, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="guided_regex.*guided_choice|only one"):
        client.completions.create(**base, extra_body={"guided_regex": "a", "guided_choice": ["b"]})


def test_prompt_logprobs_in_completions(client) -> None:
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    prompt_logprobs = r.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == r.usage.prompt_tokens
    assert all(isinstance(v["logprob"], float) for entry in prompt_logprobs[1:] for v in entry.values())


def test_tool_calls_stream_as_name_then_argument_fragments(client) -> None:
    """llama3_json parser; a named tool_choice makes the grammar force a valid call."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    pieces = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id and pieces[0].function.arguments == ""
    fragments = [p.function.arguments for p in pieces[1:]]
    assert len(fragments) > 2 and all(p.function.name is None and p.id is None for p in pieces[1:])
    assert json.loads("".join(fragments)) == json.loads(call.function.arguments)
    auto = client.chat.completions.create(**{**kwargs, "tool_choice": "auto"})
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_tool_choice_needs_the_flag(engine) -> None:
    app = build_app(engine, ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as http:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                      tools=[WEATHER_TOOL], max_tokens=4)
        # A named tool choice works without it, as in vLLM.
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      max_tokens=80, temperature=0)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tokenize_detokenize_version_fingerprint(client, http, engine) -> None:
    tok = engine.tokenizer
    r = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok("Hello world")["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    chat = http.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    assert http.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    bad = http.post("/detokenize", json={"model": "tiny", "tokens": [10**9]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    assert http.get("/version").json() == {"version": __version__}
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
    assert r.system_fingerprint and r.system_fingerprint.startswith("kiln-")
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert c.system_fingerprint == r.system_fingerprint


def test_requests_logged_one_line_each_and_metrics_named_as_vllm(client, http, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kiln.serving")
    client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 1 and "/v1/completions" in lines[0] and "max_tokens=3" in lines[0]
    text = http.get("/metrics").text
    for name in VLLM_NAMES:
        base = name.removesuffix("_total")
        assert re.search(rf'^{re.escape(name if name.endswith("_total") else base)}(_bucket|_count)?\{{[^}}]*'
                         rf'model_name="tiny"', text, re.M), name
    assert metric(text, "kiln:request_success_total", 'finished_reason="length"') >= 1
    assert metric(text, "kiln:prompt_tokens_total") > 0


def test_stats_line(engine, client) -> None:
    app = build_app(engine, ServerConfig(served_model_names=["s"]))
    with TestClient(app) as http:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        stats = StatsLogger(app.state.metrics, app.state.async_engine)
        c.completions.create(model="s", prompt="Hello there", max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
        line = stats.line()
    m = re.match(r"Avg prompt throughput: ([0-9.]+) tokens/s, Avg generation throughput: ([0-9.]+) tokens/s, "
                 r"Running: 0 reqs, Waiting: 0 reqs, KV cache usage: [0-9.]+%, Prefix cache hit rate: [0-9.]+%", line)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, line


# vLLM's OpenAI client examples, as a vLLM user has them; only the server URL changes.
VLLM_CLIENT_SCRIPT = '''
from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"

client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)

models = client.models.list()
model = models.data[0].id

completion = client.completions.create(model=model, prompt="A robot may not injure a human being",
                                       echo=False, n=2, stream=False, logprobs=3)
print("COMPLETIONS", len(completion.choices))

chat_completion = client.chat.completions.create(
    messages=[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "Who won the world series in 2020?"}],
    model=model, temperature=0, max_tokens=16)
print("CHAT", chat_completion.choices[0].finish_reason)

completion = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
    extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
print("CHOICE", completion.choices[0].message.content)

completion = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
    extra_body={"guided_choice": ["positive", "negative"]})
print("GUIDED", completion.choices[0].message.content)

tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
          "parameters": {"type": "object", "properties": {"location": {"type": "string", "maxLength": 20}},
                         "required": ["location"]}}}]
response = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What's the weather like in San Francisco?"}],
    tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64)
tool_call = response.choices[0].message.tool_calls[0].function
print("TOOL", tool_call.name, sorted(__import__("json").loads(tool_call.arguments)))

stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello"}],
                                        stream=True, max_tokens=8)
print("STREAM", sum(1 for chunk in stream) > 1)
'''


def test_vllm_client_script_against_kiln_serve_by_hub_id(tmp_path, tmp_path_factory) -> None:
    """`kiln serve --model HUB_ID` with vLLM's flags, then the client script unchanged but for its URL."""
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, HUB_ID, text_model_dir(tmp_path_factory))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "KILN_CACHE_DIR": str(tmp_path / "kiln")}
    server = start_server("--model", HUB_ID, "--max-model-len", "512", "--num-kv-blocks", "128",
                          "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice", "--chat-template",
                          str(template), "--seed", "0", "--uvicorn-log-level", "warning", env=env)
    try:
        script = VLLM_CLIENT_SCRIPT.replace("http://localhost:8000/v1", server.base_url)
        (tmp_path / "client.py").write_text(script)
        out = subprocess.run([sys.executable, str(tmp_path / "client.py")], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, NO_PROXY="*"))
        assert out.returncode == 0, out.stderr[-3000:] + server.log_tail()
        lines = out.stdout.splitlines()
        assert "COMPLETIONS 2" in lines and ("CHAT stop" in lines or "CHAT length" in lines)
        assert {"CHOICE positive", "CHOICE negative"} & set(lines)
        assert {"GUIDED positive", "GUIDED negative"} & set(lines)
        assert "TOOL get_weather ['location']" in lines and "STREAM True" in lines
        # --chat-template: the server renders chats with the given template.
        r = __import__("httpx").post(server.url + "/tokenize",
                                     json={"messages": [{"role": "user", "content": "hi"}]}).json()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(text_model_dir(tmp_path_factory)))
        assert r["tokens"] == tok("[user]hi\n[assistant]", add_special_tokens=False)["input_ids"]
        log = server.log_tail(100_000)
        assert log.count("request ") >= 6  # one line per request (--disable-log-requests is off)
    finally:
        server.stop()
