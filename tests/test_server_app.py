"""The app factory in-process on a tiny random model (no tokenizer: token-id prompts), two
apps in one process: each has its own metrics registry and engine thread."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kiln.runtime.config import EngineConfig

from kiln.runtime.engine import LLMEngine
from kiln.runtime.serving.app import ServerConfig, build_app
from server_process import metric


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    path, _ = tiny_model_dir("llama")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=64, max_num_seqs=4,
                                  num_kv_blocks=32, progress=False))


def test_two_apps_in_one_process_keep_separate_metrics(engine: LLMEngine) -> None:
    a = build_app(engine, ServerConfig(served_model_names=["a"]))
    b = build_app(engine, ServerConfig(served_model_names=["b"]))
    with TestClient(a) as ca:
        r = ca.post("/v1/completions", json={"model": "a", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert body["choices"][0]["finish_reason"] == "length"
        assert ca.post("/v1/completions", json={"model": "b", "prompt": [1]}).status_code == 404
        text_a = ca.get("/metrics").text
    with TestClient(b) as cb:
        text_b = cb.get("/metrics").text
        assert cb.get("/health").json() == {"status": "ok"}
    assert metric(text_a, "kiln:http_requests_total", 'endpoint="/v1/completions",status="200"') == 1
    assert metric(text_a, "kiln:http_requests_total", 'endpoint="/v1/completions",status="404"') == 1
    assert metric(text_a, "kiln:generation_tokens_total") == 5
    assert "kiln:http_requests_total{" not in text_b  # b served nothing
    assert metric(text_b, "kiln:generation_tokens_total") == 0


def test_without_tokenizer_text_prompts_and_chat_are_clear_400s(engine: LLMEngine) -> None:
    with TestClient(build_app(engine, ServerConfig(served_model_names=["tiny"]))) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "tokenizer" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 3, "n": 2, "temperature": 0.5,
                                           "seed": 3, "ignore_eos": True})
        assert r.status_code == 200
        body = r.json()
        assert sorted(ch["index"] for ch in body["choices"]) == [0, 1, 2, 3]
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 12
    # After the app's shutdown its engine thread is gone and nothing is left in the engine.
    assert not engine.has_unfinished()


def test_request_body_limits(engine: LLMEngine) -> None:
    with TestClient(build_app(engine, ServerConfig(served_model_names=["tiny"]))) as c:
        r = c.post("/v1/completions", content=b"{" + b" " * (33 * 1024 * 1024) + b"}",
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
