"""`kiln serve` under hostile input: no request stalls the server, bad text and deep JSON are
400s naming the field, a request larger than the queue is a 400, client chat templates are
refused unless allowed and then sandboxed with a time limit.

The limits themselves run in-process on the tiny model (fast); the stall test and the
client-template tests run against a real `kiln serve` subprocess of the default model,
through the official `openai` client where a client is used.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.serving.app import ServerConfig, build_app, start_pool_threads
from kiln.runtime.serving.protocol import MAX_JSON_DEPTH
from kiln.runtime.serving.template_sandbox import HOST_BUSY_TIMEOUT_S
from server_process import ServerProcess, start_server

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]
# ~10^8 loop iterations: seconds to minutes of CPU, far over the 2 s limit given below.
HEAVY_TEMPLATE = ("{% for i in range(10000) %}{% for j in range(10000) %}{% if i == j %}.{% endif %}"
                  "{% endfor %}{% endfor %}")


# ---- in-process: the limits, on the tiny model ------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    path, _ = tiny_model_dir("llama")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=64, max_num_seqs=4,
                                  num_kv_blocks=32, progress=False))


@pytest.fixture(scope="module")
def client(engine: LLMEngine) -> Any:
    app = build_app(engine, ServerConfig(served_model_names=["tiny"], max_waiting_requests=4,
                                         max_request_bytes=500_000, max_prompt_chars=100))
    with TestClient(app) as c:
        yield c


def error(r: Any, status: int, param: str | None, *words: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


def test_deep_json_is_a_400_before_parsing(client: Any) -> None:
    deep_prompt = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep_metadata = (b'{"messages": [{"role": "user", "content": "x"}], "metadata": ' + b'{"a": ' * 50_000 + b'"b"'
                     + b"}" * 50_000 + b"}")
    for endpoint, body in (("completions", deep_prompt), ("chat/completions", deep_metadata)):
        err = error(client.post(f"/v1/{endpoint}", content=body), 400, None, f"more than {MAX_JSON_DEPTH} levels")
        assert err["code"] == "json_too_deep"
    # Brackets inside strings are text, not nesting; depth up to the limit is fine.
    ok = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "user": "[" * 500})
    assert ok.status_code == 200, ok.text
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_JSON_DEPTH + 5):
        schema = {"type": "object", "properties": {"x": schema}}
    body = {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    error(client.post("/v1/chat/completions", json=body), 400, None, "levels deep")


@pytest.mark.parametrize("endpoint,raw,param", [
    ("completions", b'{"prompt": "abc \\ud800 def"}', "prompt"),
    ("completions", b'{"prompt": ["fine", "lone low \\udc00"]}', "prompt[1]"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}, '
                         b'{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[1].content[0].text"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "bytes \xff\xfe here"}]}',
     "messages[0].content"),
])
def test_undecodable_text_is_a_400_naming_the_field(client: Any, endpoint: str, raw: bytes, param: str) -> None:
    err = error(client.post(f"/v1/{endpoint}", content=raw), 400, param, param, "not valid text")
    assert err["code"] == "invalid_text"


def test_valid_surrogate_pairs_are_text(client: Any) -> None:
    # "\ud83d\ude00" is one emoji in JSON: valid, and it gets past the text check (to the
    # tiny model's missing tokenizer, which is the next thing it meets).
    r = client.post("/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00"}')
    error(r, 400, "prompt", "tokenizer")


def test_more_prompts_than_the_queue_holds_is_a_400(client: Any) -> None:
    err = error(client.post("/v1/completions", json={"prompt": [[1], [2], [3], [4], [5]], "max_tokens": 1}),
                400, "prompt", "5 prompts", "--max-waiting-requests", "at most 4")
    assert err["code"] == "too_many_prompts"
    ok = client.post("/v1/completions", json={"prompt": [[1], [2], [3], [4]], "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_size_limits_refuse_before_tokenizing(client: Any) -> None:
    error(client.post("/v1/completions", json={"prompt": "x" * 600_000}), 413, None, "--max-request-bytes")
    # The tiny model has no tokenizer: a 400 about size (not "no tokenizer") shows that
    # the prompt was refused before anything tried to tokenize it.
    err = error(client.post("/v1/completions", json={"prompt": "x" * 101}), 400, "prompt", "101 characters",
                "--max-prompt-chars")
    assert err["code"] == "prompt_too_large"
    error(client.post("/v1/completions", json={"prompt": ["ok", "y" * 200]}), 400, "prompt", "prompt[1]")
    error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "z" * 200}]}),
          400, "messages", "200 characters")


def test_error_messages_name_the_prompt_and_do_not_repeat_fields(client: Any) -> None:
    err = error(client.post("/v1/completions", json={"prompt": list(range(1, 61)), "max_tokens": 10}), 400,
                "prompt", "prompt:", "60 tokens", "max_model_len (64)")
    assert not err["message"].startswith("max_tokens")
    err = error(client.post("/v1/completions", json={"prompt": [1], "n": 0}), 400, "n", "n: must be between")
    assert "n: n " not in err["message"]


def test_client_chat_template_refused_by_default(client: Any) -> None:
    for body, param in (({"messages": USER, "chat_template": "{{ 'x' }}"}, "chat_template"),
                        ({"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
                         "chat_template_kwargs.chat_template")):
        err = error(client.post("/v1/chat/completions", json=body), 400, param, "--allow-client-chat-template")
        assert err["code"] == "chat_template_not_allowed"


def test_prepare_threads_are_started_before_the_first_request() -> None:
    # Started lazily, the first thread of the pool would start inside `submit`, on the loop.
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="kiln-test-prestart")
    try:
        start_pool_threads(pool, 3)
        assert sum(t.name.startswith("kiln-test-prestart") for t in threading.enumerate()) == 3
    finally:
        pool.shutdown()


def test_server_config_limits_are_checked(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="max_request_bytes"):
        build_app(engine, ServerConfig(served_model_names=["t"], max_request_bytes=0))
    with pytest.raises(ValueError, match="chat_template_timeout"):
        build_app(engine, ServerConfig(served_model_names=["t"], chat_template_timeout=0))


# ---- a real server: stalls and sandboxed templates ------------------------------------------

@pytest.fixture(scope="module")
def server() -> ServerProcess:
    srv = start_server("--api-key", API_KEY, "--served-model-name", "smol", "--max-num-seqs", "2",
                       "--max-waiting-requests", "16", "--allow-client-chat-template", "--chat-template-timeout", "2")
    yield srv
    srv.stop()


def _models_max_len(server: ServerProcess) -> int:
    r = httpx.get(server.base_url + "/models", headers=AUTH, timeout=30)
    return int(r.json()["data"][0]["max_model_len"])


@pytest.mark.slow
def test_health_answers_within_100ms_while_heavy_requests_are_prepared(server: ServerProcess) -> None:
    """The heaviest request the limits accept (a body just under the 4 MiB limit: 15 prompts,
    each at the character limit, each tokenized and then refused as too many tokens) while
    a client template loops until its time limit. /health keeps answering fast."""
    max_chars = 32 * _models_max_len(server)
    prompt = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * (max_chars // 50))[:max_chars]
    completion = json.dumps({"model": "smol", "prompt": [prompt] * 15, "max_tokens": 1}).encode()
    assert 3_500_000 < len(completion) < 4 * 2**20
    chat = json.dumps({"model": "smol", "messages": USER, "chat_template": HEAVY_TEMPLATE}).encode()
    heavy = [("completions", completion), ("chat/completions", chat)]
    results: list[tuple[int, dict[str, Any], float]] = []

    def send(endpoint: str, body: bytes) -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{server.base_url}/{endpoint}", content=body, headers={**AUTH, "content-type":
                                                                                "application/json"}, timeout=300)
        results.append((r.status_code, r.json(), time.monotonic() - t0))

    threads = [threading.Thread(target=send, args=h) for h in heavy]
    latencies: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        probe.get("/health")  # connection set up before the clock starts
        t_start = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
        busy = time.monotonic() - t_start
    for t in threads:
        t.join()
    statuses = sorted((s, body["error"]["code"] or body["error"]["param"]) for s, body, _ in results)
    assert statuses == [(400, "chat_template_timeout"), (400, "prompt")], statuses
    assert busy > 1.5 and len(latencies) >= 20, (busy, len(latencies))  # the work really was heavy
    ordered = sorted(latencies)
    worst, median, p99 = ordered[-1], ordered[len(ordered) // 2], ordered[(len(ordered) * 99) // 100]
    print(f"/health during {busy:.1f} s of heavy requests: {len(latencies)} probes, worst {worst * 1000:.1f} ms, "
          f"99th percentile {p99 * 1000:.1f} ms, median {median * 1000:.1f} ms")
    # Within 100 ms, judged at the 99th percentile: on CI's two cores the tests share the CPU
    # with a second pytest worker and an Inductor compile, and one probe in hundreds can wait
    # ~100 ms for a core (CI once saw 104 ms in 387 probes, median 2.2 ms). Work on the event
    # loop would show as a stall of seconds (a 10 MB prompt stalled /health for 14-18 s, a
    # heavy template for 1.6 s), which the worst-case bound still catches.
    assert p99 < 0.100, f"/health took {p99 * 1000:.0f} ms at the 99th percentile (median {median * 1000:.1f} ms)"
    assert worst < 0.500, f"/health took {worst * 1000:.0f} ms once (median {median * 1000:.1f} ms)"


@pytest.mark.slow
def test_client_chat_template_renders_in_the_sandbox(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    # This template writes the message text and nothing else: 3 tokens, where the model's own
    # template would add its system prompt and role markers.
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "one two three"}],
                                       max_tokens=2, extra_body={"chat_template": "{% for m in messages %}"
                                                                                  "{{ m.content }}{% endfor %}"})
    assert r.usage.prompt_tokens == 3
    own = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "one two three"}],
                                         max_tokens=2)
    assert own.usage.prompt_tokens > 10
    with pytest.raises(openai.BadRequestError) as e:  # the sandbox: no Python internals
        client.chat.completions.create(model="smol", messages=USER, max_tokens=2,
                                       extra_body={"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    assert e.value.body["param"] == "chat_template" and "unsafe" in e.value.body["message"]
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:  # the time limit (2 s of CPU here)
        client.chat.completions.create(model="smol", messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"chat_template": HEAVY_TEMPLATE}},
                                       timeout=3 * HOST_BUSY_TIMEOUT_S)
    # The child renders at nice 10: on a loaded host its 2 s of CPU take long (45 s in one CI
    # run at twice the usual CI time), bounded by the sandbox's wall-clock limits (start-up,
    # render). The code below says it was the CPU limit that ended it.
    assert time.monotonic() - t0 < 2 * HOST_BUSY_TIMEOUT_S
    assert e.value.body["code"] == "chat_template_timeout" and "2 s" in e.value.body["message"]
    assert e.value.body["param"] == "chat_template_kwargs.chat_template"
    # And the server is still fine.
    ok = client.completions.create(model="smol", prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.slow
def test_too_many_prompts_is_a_400_the_openai_client_does_not_retry(server: ServerProcess) -> None:
    requests: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda req: requests.append(str(req.url))]})
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, http_client=http, timeout=60)  # default retries
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt=["Hi"] * 17, max_tokens=1)
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
    assert "--max-waiting-requests" in e.value.body["message"]
    assert len(requests) == 1  # a 503 would have been retried


@pytest.mark.slow
def test_lone_surrogates_against_the_real_server(server: ServerProcess) -> None:
    for endpoint, raw, param in (
            ("completions", b'{"model": "smol", "prompt": "x \\ud800"}', "prompt"),
            ("chat/completions", b'{"model": "smol", "messages": [{"role": "user", "content": "\\udfff"}]}',
             "messages[0].content")):
        r = httpx.post(f"{server.base_url}/{endpoint}", content=raw, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_fast_encoder_gives_the_tokenizer_s_ids(tmp_path_factory) -> None:
    """The server tokenizes with the Rust tokenizer's `encode_batch_fast` (it holds the GIL
    far less than the transformers wrapper); the ids must be the wrapper's, special tokens
    and chat markup included."""
    from transformers import AutoTokenizer

    from runtime_text_model import text_model_dir

    tok = AutoTokenizer.from_pretrained(str(text_model_dir(tmp_path_factory)))
    fast = tok._tokenizer.encode_batch_fast
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    for text in ("Hello", "  spaces\t\ttabs\n\nnewlines", "émoji 😀 中文", "word " * 2000, chat, ""):
        for special in (True, False):
            assert fast([text], add_special_tokens=special)[0].ids == tok(text, add_special_tokens=special)["input_ids"]
