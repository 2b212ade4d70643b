"""The client chat-template sandbox: its time limit is the template's CPU time, not the host's load.

The child runs below the server's priority (nice 10); on a loaded server it may get no CPU for
seconds. These tests stop it with SIGSTOP (no CPU, wall clock running) to stand for that,
deterministically.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.serving import template_sandbox
from kiln.runtime.serving.app import ServerConfig, build_app
from kiln.runtime.serving.template_sandbox import HOST_BUSY_TIMEOUT_S, SandboxResult, render_in_sandbox

from runtime_text_model import text_model_dir

MESSAGES = [{"role": "user", "content": "one two three"}]
SIMPLE = "{% for m in messages %}{{ m.content }}{% endfor %}"
SPIN = ("{% for i in range(100000) %}{% for j in range(100000) %}{% if i == j %}.{% endif %}"
        "{% endfor %}{% endfor %}")


def render(template: str, timeout: float, **kw: Any) -> SandboxResult:
    return asyncio.run(render_in_sandbox(template, MESSAGES, None, True, {}, timeout, 10_000, **kw))


@pytest.fixture
def stopped_children(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every child the sandbox spawns is stopped (SIGSTOP) at once and continued 1.5 s later."""
    pids: list[int] = []
    spawn = asyncio.create_subprocess_exec

    async def spawn_stopped(*argv: Any, **kw: Any) -> asyncio.subprocess.Process:
        proc = await spawn(*argv, **kw)
        os.kill(proc.pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(1.5, lambda: proc.returncode is None and os.kill(proc.pid, signal.SIGCONT))
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(template_sandbox.asyncio, "create_subprocess_exec", spawn_stopped)
    return pids


def test_simple_template_renders() -> None:
    assert render(SIMPLE, 2.0) == SandboxResult(text="one two three")


def test_a_starved_child_is_not_the_templates_fault(stopped_children: list[int]) -> None:
    # 1.5 s without CPU against a 0.5 s limit: a wall-clock limit refused this template.
    t0 = time.monotonic()
    result = render(SIMPLE, 0.5)
    assert time.monotonic() - t0 >= 1.5 and len(stopped_children) == 1
    assert result == SandboxResult(text="one two three")


def test_a_child_starved_while_it_renders_is_not_the_templates_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stopped when it says it is ready (the parent's first look at its CPU time), continued
    # 1.5 s later: the template's own time is still ~0 against a 0.5 s limit.
    cpu_seconds = template_sandbox._cpu_seconds
    looks: list[int] = []

    def stop_at_first_look(pid: int) -> float | None:
        if not looks:
            os.kill(pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(1.5, lambda: os.kill(pid, signal.SIGCONT))
        looks.append(pid)
        return cpu_seconds(pid)

    monkeypatch.setattr(template_sandbox, "_cpu_seconds", stop_at_first_look)
    t0 = time.monotonic()
    result = render(SIMPLE, 0.5)
    assert time.monotonic() - t0 >= 1.5 and len(looks) >= 3  # it looked while the child was stopped
    assert result == SandboxResult(text="one two three")


def test_a_child_starved_past_the_host_limit_is_a_busy_host(stopped_children: list[int]) -> None:
    result = render(SIMPLE, 0.5, host_busy_timeout=0.5)
    assert result == SandboxResult(host_busy=True)
    assert not os.path.exists(f"/proc/{stopped_children[0]}")  # killed and reaped


def test_a_spinning_template_is_cut_at_its_cpu_limit() -> None:
    t0 = time.monotonic()
    result = render(SPIN, 0.5)
    assert result == SandboxResult(timed_out=True)
    # Wall clock: the nice-10 child's 0.5 s of CPU, bounded on a loaded host by the
    # sandbox's own wall-clock limits (start-up, render).
    assert time.monotonic() - t0 < 2 * HOST_BUSY_TIMEOUT_S


def test_template_errors_come_back() -> None:
    result = render("{{ raise_exception('no system role') }}", 2.0)
    assert result.error is not None and "no system role" in result.error


def test_the_server_answers_a_starved_renderer_with_a_503_to_retry(
        stopped_children: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Through the real app, on a tiny model with a tokenizer: the client's template is not
    blamed (no 400); the client is told to retry; the next request is served."""
    monkeypatch.setattr(template_sandbox, "HOST_BUSY_TIMEOUT_S", 0.5)
    engine = LLMEngine(EngineConfig(model=str(text_model_dir(tmp_path_factory)), device="cpu", max_model_len=64,
                                    max_num_seqs=2, progress=False))
    app = build_app(engine, ServerConfig(served_model_names=["tiny"], allow_client_chat_template=True))
    body = {"model": "tiny", "messages": MESSAGES, "chat_template": SIMPLE, "max_tokens": 1}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
        err = r.json()["error"]
        assert err["code"] == "renderer_busy" and err["param"] == "chat_template" and "overloaded" in err["message"]
        monkeypatch.setattr(template_sandbox, "HOST_BUSY_TIMEOUT_S", 60.0)
        ok = client.post("/v1/chat/completions", json=body)  # stopped for 1.5 s this time too, and served
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] > 0
    assert len(stopped_children) == 2
