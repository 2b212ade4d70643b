"""Fuzz `kiln serve`: hundreds of mixed good and bad requests, 16 at a time, and /health throughout.

    python bench/fuzz_server.py                        # starts `kiln serve --api-key` (default model) itself
    python bench/fuzz_server.py --base-url http://127.0.0.1:8000 --api-key KEY   # a running server

It sends `--num-requests` requests (a seeded random mix: good completions and chats, some
streamed, and bad ones of every kind the server must refuse cleanly: broken JSON, wrong
types, unknown fields, out-of-range values, lone surrogates and non-UTF-8 bytes, JSON
nested 100,000 deep, a 10 MB prompt, a prompt over the character limit, more prompts
than the queue holds, client chat templates (a heavy one among them), missing or wrong
API keys, unknown models and paths, and random mutations of good bodies), at most
`--concurrency` in flight. A prober asks /health every 50 ms the whole time.

It prints one JSON document: requests sent, statuses, 500s (must be 0), requests whose
status was not one their category allows (with a sample), good requests answered 200,
and /health's worst and median latency. Exit status 1 if any request got a 5xx, any got an
unexpected status, or /health ever took 100 ms or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

import bench_common as bc  # bench/ is on sys.path when run as `python bench/fuzz_server.py`

GOOD = (200,)
BAD = (400, 404, 413, 422)  # 422 never happens with Kiln, but is a fine answer to bad input


@dataclass
class Case:
    category: str
    endpoint: str  # "completions", "chat/completions", or a path starting with "/"
    body: bytes | None
    expected: tuple[int, ...]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    method: str = "POST"


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def make_cases(rng: random.Random, n: int, model: str) -> list[Case]:
    user = [{"role": "user", "content": "Say hi."}]
    heavy_template = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"

    def good() -> Case:
        stream = rng.random() < 0.3
        if rng.random() < 0.5:
            body = {"model": model, "prompt": rng.choice(["Hello", "The capital of France is", "1, 2, 3,"]),
                    "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
            return Case("good", "completions", _j(body), GOOD, stream=stream)
        body = {"model": model, "messages": [{"role": "user", "content": rng.choice(["Hi", "What is 2+2?", "Name a color."])}],
                "max_tokens": rng.randint(1, 6), "seed": rng.randint(0, 1000), "stream": stream}
        return Case("good", "chat/completions", _j(body), GOOD, stream=stream)

    junk_values: list[Any] = [None, -1, 0, 1e308, -1e308, "str", "", [], {}, [[]], {"a": 1}, True, 2**70, "x" * 5000,
                              ["a", 1, None], 3.5]

    def mutated() -> Case:
        if rng.random() < 0.5:
            body: dict[str, Any] = {"model": model, "prompt": "Hello", "max_tokens": 2}
            fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "logprobs", "seed",
                      "presence_penalty", "frequency_penalty", "stream", "echo", "min_tokens", "stop_token_ids", "model"]
            endpoint = "completions"
        else:
            body = {"model": model, "messages": user, "max_tokens": 2}
            fields = ["messages", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "top_logprobs",
                      "tools", "tool_choice", "response_format", "seed", "stream", "model", "metadata"]
            endpoint = "chat/completions"
        name, value = rng.choice(fields), rng.choice(junk_values)
        if name == "max_tokens" and value is None:
            value = -1  # null is valid and means "to the end of the context": minutes of decoding on CPU
        body[name] = value
        # A random mutation may happen to be valid (e.g. temperature 0): any 200 or 4xx is fine.
        return Case("mutated", endpoint, _j(body), (200, 400, 404, 413))

    bad_makers: list[Any] = [
        lambda: Case("broken_json", "completions", b'{"prompt": "x", "max_tokens": ', BAD),
        lambda: Case("empty_body", "completions", b"", BAD),
        lambda: Case("not_object", "chat/completions", b"[1, 2, 3]", BAD),
        lambda: Case("nan", "completions", b'{"prompt": "x", "temperature": NaN}', BAD),
        # An unknown top-level field is accepted and logged once, as vLLM does (clients add
        # fields of their own); one inside a nested object is refused.
        lambda: Case("unknown_field", "completions", _j({"prompt": "x", "max_tokens": 4, "temprature": 0.5}), GOOD),
        lambda: Case("unknown_nested_field", "chat/completions", _j({"messages": [{"role": "user", "content": "x", "nmae": "y"}]}),
                     BAD),
        lambda: Case("wrong_type", "completions", _j({"prompt": "x", "max_tokens": "ten"}), BAD),
        lambda: Case("out_of_range", "completions", _j({"prompt": "x", "top_p": 7}), BAD),
        lambda: Case("n_zero", "chat/completions", _j({"messages": user, "n": 0}), BAD),
        lambda: Case("bad_role", "chat/completions", _j({"messages": [{"role": "wizard", "content": "x"}]}), BAD),
        lambda: Case("surrogate_prompt", "completions", b'{"prompt": "x \\ud800 y"}', BAD),
        lambda: Case("surrogate_chat", "chat/completions",
                     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', BAD),
        lambda: Case("non_utf8", "completions", b'{"prompt": "bad \xff\xfe bytes"}', BAD),
        lambda: Case("deep_prompt", "completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", BAD),
        lambda: Case("deep_metadata", "chat/completions",
                     b'{"messages": [{"role": "user", "content": "x"}], "metadata": ' + b'{"a": ' * 50_000 + b'"b"'
                     + b"}" * 50_000 + b"}", BAD),
        lambda: Case("prompt_10mb", "completions", _j({"prompt": "hello world " * 875_000, "max_tokens": 1}), BAD),
        lambda: Case("prompt_over_char_limit", "completions", _j({"prompt": "hello " * 60_000, "max_tokens": 1}), BAD),
        lambda: Case("prompt_too_many_tokens", "completions", _j({"prompt": "word " * 9000, "max_tokens": 10}), BAD),
        lambda: Case("too_many_prompts", "completions", _j({"prompt": ["hi"] * 600, "max_tokens": 1}), BAD),
        lambda: Case("client_template", "chat/completions",
                     _j({"messages": user, "chat_template_kwargs": {"chat_template": heavy_template}}), BAD),
        lambda: Case("client_template_field", "chat/completions",
                     _j({"messages": user, "chat_template": "{{ messages }}"}), BAD),
        lambda: Case("bad_tool_schema", "chat/completions", _j({"messages": user, "tools": [{"type": "function",
                     "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]}),
                     BAD),
        lambda: Case("unknown_model", "completions", _j({"model": "gpt-17", "prompt": "x"}), BAD),
        lambda: Case("unknown_path", "/v1/nothing", _j({"prompt": "x"}), BAD),
        lambda: Case("no_api_key", "completions", _j({"prompt": "x"}), (401,), headers={"Authorization": ""}),
        lambda: Case("wrong_api_key", "chat/completions", _j({"messages": user}), (401,),
                     headers={"Authorization": "Bearer wrong"}),
    ]
    cases = []
    for _ in range(n):
        r = rng.random()
        if r < 0.25:
            cases.append(good())
        elif r < 0.45:
            cases.append(mutated())
        else:
            cases.append(rng.choice(bad_makers)())
    return cases


async def send(http: httpx.AsyncClient, base_url: str, api_key: str, case: Case) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", **case.headers}
    headers = {k: v for k, v in headers.items() if v}
    url = base_url + case.endpoint if case.endpoint.startswith("/") else f"{base_url}/v1/{case.endpoint}"
    try:
        async with http.stream(case.method, url, content=case.body, headers=headers) as r:
            text = (await r.aread()).decode(errors="replace")
            if r.status_code == 200 and case.stream and "data: [DONE]" not in text:
                return 299, "stream did not end with [DONE]"
            if r.status_code == 200 and case.stream and '"error"' in text:
                return 599, text[-300:]
            return r.status_code, text[:300]
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"


def probe_health(base_url: str, stop: Any, out: Any) -> None:
    """/health every 50 ms until `stop` is set; sends (latencies, failures) back through `out`.
    Runs in its own process, so the fuzzer's own event loop (uploading 10 MB bodies,
    reading streams) never delays a probe: the latency is the server's."""
    latencies: list[float] = []
    failures: list[str] = []
    with httpx.Client(timeout=30) as http:
        http.get(base_url + "/health")  # the connection, before the clock starts
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = http.get(base_url + "/health")
                if r.status_code != 200:
                    failures.append(f"/health {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(f"/health {type(e).__name__}")
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    out.send((latencies, failures))


async def run(base_url: str, api_key: str, cases: list[Case], concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    receive, send_end = ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe_health, args=(base_url, stop, send_end), daemon=True)
    prober.start()
    await asyncio.sleep(2.0)  # the prober's start-up (imports), so that it watches every request
    limits = httpx.Limits(max_connections=concurrency + 4)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        async def one(case: Case) -> tuple[Case, int, str]:
            async with sem:
                status, text = await send(http, base_url, api_key, case)
            return case, status, text

        results = await asyncio.gather(*(one(c) for c in cases))
    elapsed = time.monotonic() - t0
    stop.set()
    latencies, health_failures = receive.recv()
    prober.join(30)
    statuses = Counter(str(s) for _, s, _ in results)
    by_category: dict[str, Counter] = {}
    unexpected = []
    for case, status, text in results:
        by_category.setdefault(case.category, Counter())[str(status)] += 1
        if status not in case.expected:
            unexpected.append({"category": case.category, "status": status, "body": text[:200]})
    good = [(c, s) for c, s, _ in results if c.category == "good"]
    lat = sorted(latencies)
    return {
        "requests": len(results), "concurrency": concurrency, "elapsed_s": round(elapsed, 1),
        "statuses": dict(sorted(statuses.items())),
        "server_errors_5xx": sum(1 for _, s, _ in results if s >= 500),
        "errors_500": statuses.get("500", 0),
        "unexpected": len(unexpected), "unexpected_sample": unexpected[:10],
        "good_requests": {"sent": len(good), "ok": sum(1 for _, s in good if s == 200)},
        "by_category": {k: dict(v) for k, v in sorted(by_category.items())},
        "health": {"probes": len(lat), "worst_ms": round(lat[-1] * 1000, 1) if lat else None,
                   "p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
                   "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1) if lat else None,
                   "failures": health_failures[:5]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server (default: start `kiln serve --api-key`)")
    ap.add_argument("--api-key", default="fuzz-key")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `kiln serve` options when this script starts it")
    args = ap.parse_args()

    proc = log = None
    if args.base_url is None:
        proc, base_url, log = bc.start_kiln_serve(["--api-key", args.api_key, *args.serve_args.split()], "kiln-fuzz-")
    else:
        base_url = args.base_url.rstrip("/")
    try:
        model = args.model or httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"},
                                        timeout=30).json()["data"][0]["id"]
        cases = make_cases(random.Random(args.seed), args.num_requests, model)
        report = asyncio.run(run(base_url, args.api_key, cases, args.concurrency))
        report["server"] = base_url if proc is None else f"kiln serve --api-key (default model) on {base_url}"
        report["seed"] = args.seed
    finally:
        if proc is not None:
            bc.stop_kiln_serve(proc)
            if log is not None:
                os.unlink(log)
    print(json.dumps(report, indent=1))
    worst = report["health"]["worst_ms"]
    ok = report["server_errors_5xx"] == 0 and report["unexpected"] == 0 and worst is not None and worst < 100
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
