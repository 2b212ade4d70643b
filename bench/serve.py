"""Load generator for `kiln serve`: Poisson arrivals, bounded concurrency, random prompts.

    python bench/serve.py --rates 0.5,2 --num-requests 40              # starts `kiln serve` itself
    python bench/serve.py --base-url http://127.0.0.1:8000 --rates 4   # an already running server
    python bench/serve.py --preset h200-llama3-8b --out serve.json     # the QPS / P99 table on the H200
    python bench/plot_results.py --serve serve.json --out serve.png    # its rate-vs-latency curves

`--preset h200-llama3-8b` is the serving table's setting: the Llama-3-8B shape with dummy
weights and a real tokenizer (`bench/llama3_8b_serve`, see bench/make_serve_model.py),
prompts of 128-1,024 tokens and outputs of 128-512 tokens (uniform, token-id prompts, so
lengths are exact), rates from light to saturated (`inf`: every request at once), up to
1,024 requests in flight. Any option given explicitly overrides the preset's.
`--quantization fp8 --kv-cache-dtype fp8` are passed to `kiln serve` (and to the baseline).

For each request rate it sends `--num-requests` streaming completions whose arrival times
form a Poisson process at that rate (exponential gaps), never more than `--max-concurrency`
in flight, each with a random prompt of random length and a fixed number of output tokens
(`ignore_eos`, so every request decodes the same amount). It prints one JSON document:
per rate, achieved requests/s and output tokens/s, time to first token (TTFT, from sending
the request to its first streamed token) and time per output token (TPOT, the rest of the
decode divided by the tokens after the first) at P50 and P99, and the errors; `table` is
the same as one row per rate in milliseconds (the QPS / P99 table). With `--out` the file
is rewritten after every rate, so a run cut short keeps the rates it finished.

Baseline (when it starts the server itself, unless --no-baseline): after the server has
stopped, the same prompts through the offline `LLM.generate` in this process, all at once:
the engine's throughput with no HTTP, no streaming and no arrival gaps, i.e. the ceiling
the served requests/s approach as the rate grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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


# Token ids random prompts are drawn from: clear of the special tokens at the start of every
# vocabulary this benchmark is run with (SmolLM2's 49,152, Llama 3's 128,256).
TOKEN_ID_RANGE = (1000, 30000)

PRESETS: dict[str, dict[str, Any]] = {
    "h200-llama3-8b": {
        "model": str(Path(__file__).resolve().parent / "llama3_8b_serve"), "load_format": "dummy",
        "prompt_tokens": "128,1024", "output_tokens": "128,512", "rates": "2,4,8,16,24,32,48,inf",
        "num_requests": 150, "max_concurrency": 1024, "max_model_len": 2048,
    },
}


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


def random_token_prompt(rng: random.Random, min_tokens: int, max_tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(rng.randint(min_tokens, max_tokens))]


async def one_request(http: httpx.AsyncClient, url: str, model: str | None, prompt: str | list[int], max_tokens: int,
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
                   prompts: list[str | list[int]], max_tokens: list[int], api_key: str | None,
                   seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as http:
        async def bounded(prompt: str | list[int], n: int) -> RequestResult:
            async with sem:
                return await one_request(http, base_url + "/v1/completions", model, prompt, n, headers)

        tasks = []
        t0 = time.perf_counter()
        for i in range(num_requests):
            tasks.append(asyncio.create_task(bounded(prompts[i % len(prompts)], max_tokens[i % len(max_tokens)])))
            if i + 1 < num_requests and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
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


# Engine options this script takes itself and hands to both `kiln serve` and the baseline.
ENGINE_OPTIONS = ("max_model_len", "load_format", "dtype", "quantization", "kv_cache_dtype", "max_num_seqs",
                  "max_num_batched_tokens")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    flags = [x for k, v in engine_options(args).items() for x in ("--" + k.replace("_", "-"), str(v))]
    serve_args = ([args.model] if args.model else []) + flags + list(args.serve_arg)
    return bc.start_kiln_serve(serve_args, "kiln-bench-serve-")


def offline_baseline(args: argparse.Namespace, prompts: list[str | list[int]], max_tokens: list[int]
                     ) -> dict[str, Any]:
    """The same prompts through `LLM.generate` at once (no server): the engine's own ceiling."""
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(args.model, progress=False, **engine_options(args))
    params = [SamplingParams(max_tokens=max_tokens[i % len(max_tokens)], temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
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
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named setting (model, lengths, rates); options given explicitly override it")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="for the started server (default: 1024, or the longest prompt + output if longer)")
    p.add_argument("--load-format", default=None, help="for the started server and the baseline (e.g. dummy)")
    p.add_argument("--dtype", default=None, help="for the started server and the baseline")
    p.add_argument("--max-num-seqs", type=int, default=None, help="for the started server and the baseline")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="for the started server and the baseline")
    p.add_argument("--quantization", default=None, help="for the started server and the baseline (e.g. fp8)")
    p.add_argument("--kv-cache-dtype", default=None, help="for the started server and the baseline (e.g. fp8)")
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"))
    p.add_argument("--rates", default="0.5,2", help="request rates in requests/s, comma-separated; 'inf' sends "
                                                    "every request at once (default 0.5,2)")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate (default 40)")
    p.add_argument("--max-concurrency", type=int, default=16, help="most requests in flight (default 16)")
    p.add_argument("--prompt-words", default="8,48", help="min,max words per random prompt (default 8,48)")
    p.add_argument("--prompt-tokens", default=None, help="MIN,MAX: random token-id prompts of uniform length "
                                                         "instead of --prompt-words")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--output-tokens", default=None, help="MIN,MAX: each request's output length, uniform "
                                                         "(instead of --max-tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here (also printed)")
    p.add_argument("--no-baseline", action="store_true", help="skip the offline LLM.generate baseline")
    args = p.parse_args(argv)
    if args.preset:
        # The preset fills what the command line left at its default.
        for key, value in PRESETS[args.preset].items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)

    def span(text: str, flag: str) -> tuple[int, int]:
        try:
            lo, hi = (int(x) for x in text.split(","))
        except ValueError:
            p.error(f"{flag} must be MIN,MAX")
        if not 1 <= lo <= hi:
            p.error(f"{flag} must be MIN,MAX with 1 <= MIN <= MAX")
        return lo, hi

    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        p.error("--rates must be positive numbers (or inf)")
    if args.num_requests < 1 or args.max_concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --max-concurrency and --max-tokens must be >= 1")

    rng = random.Random(args.seed)
    if args.prompt_tokens:
        lo, hi = span(args.prompt_tokens, "--prompt-tokens")
        prompts: list[str | list[int]] = [random_token_prompt(rng, lo, hi) for _ in range(args.num_requests)]
    else:
        lo, hi = span(args.prompt_words, "--prompt-words")
        prompts = [random_prompt(rng, lo, hi) for _ in range(args.num_requests)]
    out_lo, out_hi = span(args.output_tokens, "--output-tokens") if args.output_tokens else (args.max_tokens,) * 2
    max_tokens = [rng.randint(out_lo, out_hi) for _ in range(args.num_requests)]
    if args.max_model_len is None:
        longest = max(len(x) for x in prompts) + out_hi if args.prompt_tokens else 0
        args.max_model_len = max(1024, -(-longest // 16) * 16)
    proc = None
    log_path = None
    started = time.perf_counter()
    if args.base_url is None:
        proc, base_url, log_path = start_server(args)
        model = None
    else:
        base_url, model = args.base_url.rstrip("/"), args.model
    startup_s = time.perf_counter() - started
    config = {"num_requests": args.num_requests, "max_concurrency": args.max_concurrency,
              "prompt_tokens" if args.prompt_tokens else "prompt_words": [lo, hi],
              "output_tokens": [out_lo, out_hi], "seed": args.seed, "preset": args.preset,
              "engine_options": engine_options(args), "serve_args": list(args.serve_arg),
              "model_config": _model_config(args.model)}
    results: list[dict[str, Any]] = []

    def report(baseline: dict[str, Any] | None, final: bool) -> None:
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        document = {
            "benchmark": "serve",
            "server": base_url if args.base_url else f"kiln serve {args.model or '(default model)'} (started here, "
                                                     f"{startup_s:.1f}s to healthy)",
            "environment": {**bc.environment(), "platform": platform.platform(), "cpus": os.cpu_count(),
                            "load_average_1_5_15": load},
            "config": config,
            "results": results,
            "table": [table_row(r) for r in results],
            "baseline_offline_generate": baseline,
            "complete": final,
        }
        if final:
            bc.emit(document, args.out)
        elif args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(document, indent=1) + "\n")

    try:
        # One short request first so that lazy start-up work does not land in the first rate.
        asyncio.run(run_rate(base_url, model, 100.0, 1, 1, prompts[:1], [2], args.api_key, args.seed))
        for i, rate in enumerate(rates):
            results.append(asyncio.run(run_rate(base_url, model, rate, args.num_requests, args.max_concurrency,
                                                prompts, max_tokens, args.api_key, args.seed + i)))
            report(None, final=False)
    finally:
        if proc is not None:
            bc.stop_kiln_serve(proc)
            if log_path is not None and proc.returncode == 0:
                log_path.unlink(missing_ok=True)
    baseline = None
    if proc is not None and not args.no_baseline:
        baseline = offline_baseline(args, prompts, max_tokens)
    report(baseline, final=True)
    return 0 if all(r["errors"] == 0 for r in results) else 1


def table_row(result: dict[str, Any]) -> dict[str, Any]:
    """One row of the QPS / P99 table: offered rate, achieved rates, latencies in ms."""
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 1)

    return {"rate": result["request_rate"], "requests_per_s": round(result["requests_per_s"], 2),
            "output_tokens_per_s": round(result["output_tokens_per_s"], 1),
            "ttft_p50_ms": ms(result["ttft_s"]["p50"]), "ttft_p99_ms": ms(result["ttft_s"]["p99"]),
            "tpot_p50_ms": ms(result["tpot_s"]["p50"]), "tpot_p99_ms": ms(result["tpot_s"]["p99"]),
            "errors": result["errors"]}


def _model_config(model: str | None) -> dict[str, Any] | None:
    """The shape the run served (a config directory's config.json), for the record."""
    if model and (Path(model) / "config.json").is_file():
        return json.loads((Path(model) / "config.json").read_text())
    return None


if __name__ == "__main__":
    sys.exit(main())
