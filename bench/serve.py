"""Load generator for `kiln serve`: Poisson arrivals, bounded concurrency, random prompts.

    python bench/serve.py --rates 0.5,2 --num-requests 40              # starts `kiln serve` itself
    python bench/serve.py --base-url http://127.0.0.1:8000 --rates 4   # an already running server

For each request rate it sends `--num-requests` streaming completions whose arrival times
form a Poisson process at that rate (exponential gaps), never more than `--max-concurrency`
in flight, each with a random prompt of random length and a fixed number of output tokens
(`ignore_eos`, so every request decodes the same amount). It prints one JSON document:
per rate, achieved requests/s and output tokens/s, time to first token (TTFT, from sending
the request to its first streamed token) and time per output token (TPOT, the rest of the
decode divided by the tokens after the first) at P50 and P99, and the errors.

Baseline (when it starts the server itself, unless --no-baseline): after the server has
stopped, the same prompts through the offline `LLM.generate` in this process, all at once:
the engine's throughput with no HTTP, no streaming and no arrival gaps, i.e. the ceiling
the served requests/s approach as the rate grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import bench_common as bc  # bench/ is on sys.path when run as `python bench/serve.py`

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None


def random_prompt(rng: random.Random, min_words: int, max_words: int) -> str:
    n = rng.randint(min_words, max_words)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    # Linear interpolation between closest ranks.
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None}


async def one_request(http: httpx.AsyncClient, url: str, model: str | None, prompt: str, max_tokens: int,
                      headers: dict[str, str]) -> RequestResult:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None or tokens == 0:
        return RequestResult(False, error="no tokens streamed")
    tpot = (end - first) / (tokens - 1) if tokens > 1 else None
    return RequestResult(True, ttft=first - start, tpot=tpot, e2e=end - start, output_tokens=tokens)


async def run_rate(base_url: str, model: str | None, rate: float, num_requests: int, max_concurrency: int,
                   prompts: list[str], max_tokens: int, api_key: str | None, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as http:
        async def bounded(prompt: str) -> RequestResult:
            async with sem:
                return await one_request(http, base_url + "/v1/completions", model, prompt, max_tokens, headers)

        tasks = []
        t0 = time.perf_counter()
        for i in range(num_requests):
            tasks.append(asyncio.create_task(bounded(prompts[i % len(prompts)])))
            if i + 1 < num_requests:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "request_rate": rate,
        "num_requests": num_requests,
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "ttft_s": summary([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": summary([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": summary([r.e2e for r in ok if r.e2e is not None]),
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    serve_args = ([args.model] if args.model else []) + ["--max-model-len", str(args.max_model_len), *args.serve_arg]
    return bc.start_kiln_serve(serve_args, "kiln-bench-serve-")


def offline_baseline(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """The same prompts through `LLM.generate` at once (no server): the engine's own ceiling."""
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len, progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up, as for the server
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"num_requests": len(prompts), "duration_s": duration, "requests_per_s": len(prompts) / duration,
            "output_tokens_per_s": tokens / duration}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start `kiln serve` here)")
    p.add_argument("--model", default=None, help="model for the started server (default: the default model); "
                                                 "with --base-url, the model name to send")
    p.add_argument("--serve-arg", action="append", default=[], help="extra option for the started `kiln serve`")
    p.add_argument("--max-model-len", type=int, default=1024, help="for the started server (default 1024)")
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"))
    p.add_argument("--rates", default="0.5,2", help="request rates in requests/s, comma-separated (default 0.5,2)")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate (default 40)")
    p.add_argument("--max-concurrency", type=int, default=16, help="most requests in flight (default 16)")
    p.add_argument("--prompt-words", default="8,48", help="min,max words per random prompt (default 8,48)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here (also printed)")
    p.add_argument("--no-baseline", action="store_true", help="skip the offline LLM.generate baseline")
    args = p.parse_args(argv)

    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        p.error("--rates must be positive numbers")
    lo, hi = (int(x) for x in args.prompt_words.split(","))
    if not 1 <= lo <= hi:
        p.error("--prompt-words must be MIN,MAX with 1 <= MIN <= MAX")
    if args.num_requests < 1 or args.max_concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --max-concurrency and --max-tokens must be >= 1")

    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, lo, hi) for _ in range(args.num_requests)]
    proc = None
    log_path = None
    started = time.perf_counter()
    if args.base_url is None:
        proc, base_url, log_path = start_server(args)
        model = None
    else:
        base_url, model = args.base_url.rstrip("/"), args.model
    startup_s = time.perf_counter() - started
    try:
        # One short request first so that lazy start-up work does not land in the first rate.
        asyncio.run(run_rate(base_url, model, 100.0, 1, 1, prompts[:1], 2, args.api_key, args.seed))
        results = [asyncio.run(run_rate(base_url, model, rate, args.num_requests, args.max_concurrency, prompts,
                                        args.max_tokens, args.api_key, args.seed + i))
                   for i, rate in enumerate(rates)]
    finally:
        if proc is not None:
            bc.stop_kiln_serve(proc)
            if log_path is not None and proc.returncode == 0:
                log_path.unlink(missing_ok=True)
    baseline = None
    if proc is not None and not args.no_baseline:
        baseline = offline_baseline(args, prompts)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    bc.emit({
        "benchmark": "serve",
        "server": base_url if args.base_url else f"kiln serve {args.model or '(default model)'} (started here, "
                                                 f"{startup_s:.1f}s to healthy)",
        "environment": {**bc.environment(), "platform": platform.platform(), "cpus": os.cpu_count(),
                        "load_average_1_5_15": load},
        "config": {"num_requests": args.num_requests, "max_concurrency": args.max_concurrency,
                   "prompt_words": [lo, hi], "max_tokens": args.max_tokens, "seed": args.seed},
        "results": results,
        "baseline_offline_generate": baseline,
    }, args.out)
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
