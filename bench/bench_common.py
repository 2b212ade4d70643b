"""What the benchmarks share: the model, the environment record, the bandwidth probe, the
Hugging Face baseline model, and JSON output. Benchmarks are scripts (`python bench/X.py`),
so this module is imported by file location, not as part of the kiln package."""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = BENCH_DIR / "llama3_8b.json"  # Llama-3-8B's architecture; weights are dummy


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="config .json (with --load-format dummy), HF directory or GGUF file (default: Llama-3-8B shape)")
    parser.add_argument("--load-format", default="dummy", help="weights: dummy (random, the default) or auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the JSON result here (also printed)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Hugging Face transformers baseline")
    parser.add_argument("--decode-buckets", default=None, help="comma-separated decode bucket sizes (default: the engine's)")
    parser.add_argument("--token-buckets", default=None, help="comma-separated token bucket sizes (default: the engine's)")
    add_mixed_graph_arg(parser)


def add_mixed_graph_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cuda-graph-mixed-tokens", type=int, default=None,
                        help="CUDA graphs for mixed steps of up to this many tokens (default: the engine's)")


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    """FP8 (issue 16): with either flag, the unquantized engine runs first and then the one
    with these options, in the same run (results under "kiln" and "kiln_quantized")."""
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="also run Kiln with FP8 projections (after the unquantized run)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="also run Kiln with this KV-cache dtype (with --quantization: both at once)")
    parser.add_argument("--quantized-only", action="store_true",
                        help="skip the unquantized run (A/B runs of the quantized engine, e.g. under "
                             "KILN_FP8_FAST_ACCUM=0 and 1)")


def precision_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(result key, extra LLM options) for each Kiln engine the run measures, in order."""
    options: dict[str, Any] = {}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "quantized_only", False):
        if not options:
            raise SystemExit("--quantized-only needs --quantization or --kv-cache-dtype")
        return [("kiln_quantized", options)]
    return [("kiln", {})] + ([("kiln_quantized", options)] if options else [])


def quantized_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM options of --quantization / --kv-cache-dtype alone (profiles run one engine)."""
    return precision_variants(args)[-1][1]


def bucket_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine options for the bucket plan: fewer buckets compile faster on a cold cache."""
    out: dict[str, Any] = {}
    if args.decode_buckets:
        out["decode_buckets"] = [int(x) for x in args.decode_buckets.split(",")]
    if args.token_buckets:
        out["token_buckets"] = [int(x) for x in args.token_buckets.split(",")]
    if getattr(args, "cuda_graph_mixed_tokens", None) is not None:
        out["cuda_graph_mixed_tokens"] = args.cuda_graph_mixed_tokens
    return out


def bucket_flags(args: argparse.Namespace, for_compile: bool = False) -> list[str]:
    """The same options as command-line flags, for a child process of the script (its own
    parser's `--decode-buckets`, ...) or for `kiln compile` (`--buckets decode:... tokens:...`),
    so that a cache built by one is the one the other looks up (mixed graphs' sizes included:
    they key the Triton-kernel entry)."""
    flags: list[str] = []
    if for_compile:
        plan = [f"decode:{args.decode_buckets}"] if args.decode_buckets else []
        plan += [f"tokens:{args.token_buckets}"] if args.token_buckets else []
        flags += ["--buckets", *plan] if plan else []
    else:
        flags += ["--decode-buckets", args.decode_buckets] if args.decode_buckets else []
        flags += ["--token-buckets", args.token_buckets] if args.token_buckets else []
    if getattr(args, "cuda_graph_mixed_tokens", None) is not None:
        flags += ["--cuda-graph-mixed-tokens", str(args.cuda_graph_mixed_tokens)]
    return flags


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_count"] = torch.cuda.device_count()
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    env["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    return env


def load_config(model: str, load_format: str) -> Any:
    from kiln.compiler.model_source import resolve_model

    return resolve_model(model, load_format).config


def weight_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes of every parameter of the architecture (what a decode step reads, the embedding
    table aside: the issue's bandwidth limit counts them all, and so do we)."""
    from kiln.compiler.capture import parameter_shapes

    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in parameter_shapes(config).values()) * elem


def weight_bytes_quantized(config: Any, dtype: torch.dtype) -> int:
    """`weight_bytes` under quantization="fp8": the decoder layers' projections at one byte per
    parameter, the embedding, LM head, norms and MoE routers in `dtype` (kiln.passes.quantize_fp8
    leaves those; its per-channel scales add 4 bytes per output row, counted too)."""
    from kiln.compiler.capture import parameter_shapes

    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, shape in parameter_shapes(config).items():
        if len(shape) == 2 and ".layers." in name and name.endswith("proj.weight"):
            total += math.prod(shape) + 4 * shape[0]
        else:
            total += math.prod(shape) * elem
    return total


def copy_bandwidth(device: torch.device, gib: float = 4.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written, per second);
    on CPU, memory-to-memory (bench/tp.py runs on CPU with a smaller `gib`)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    free_cuda()
    return 2 * n * 2 * repeats / elapsed


def hf_attention(config: Any) -> str:
    """The attention implementation the baseline runs: sdpa, or eager for an architecture
    transformers runs without it (Mamba and Falcon-Mamba have no attention at all, and
    transformers refuses sdpa for them)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[type(config)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def hf_model(config: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The transformers model of the same architecture with random weights (eager, with
    `hf_attention`'s attention: sdpa where transformers has it)."""
    import copy

    from transformers import AutoModelForCausalLM

    # A copy: transformers' from_config writes the dtype and the attention implementation
    # onto the config it is given, and the caller may pass the same config to Kiln.
    config = copy.deepcopy(config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=hf_attention(config))
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_cuda() -> None:
    import gc

    # An engine freezes the heap it started with (gc.freeze, kiln.runtime.engine): unfreeze so
    # that a deleted engine's cycles, which hold its weights and KV cache, are collected too.
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def kiln_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}[name]


def start_kiln_serve(serve_args: list[str], log_prefix: str, timeout: float = 600.0
                     ) -> tuple[subprocess.Popen, str, Path]:
    """`kiln serve SERVE_ARGS` on a free loopback port, its output in a temporary log file;
    returns once /health answers 200: (process, base URL, log path)."""
    import os
    import socket
    import tempfile

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "".join(Path(log.name).read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise SystemExit(f"kiln serve exited with {proc.returncode}; log: {log.name}; its end:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, Path(log.name)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"kiln serve did not start in {timeout:.0f}s; log: {log.name}")


def stop_kiln_serve(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains in-flight requests), then kill after a minute."""
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


L2_BYTES = 60 * 2**20  # a little more than the H200's 50 MB L2


def weights_past_l2(n: int, k: int, fp8: bool, generator: torch.Generator, min_copies: int = 1) -> list[Any]:
    """Random [n, k] bf16 weights (scale 0.02) on CUDA, as many copies as together exceed the
    L2 cache, so that calls rotating over them read each weight from HBM as a decode step
    does; with `fp8`, each as (e4m3 [n, k], float32 [n]) per-channel quantized."""
    from kiln.kernels.fp8 import quantize_fp8_rowwise

    copies = max(min_copies, -(-L2_BYTES // (n * k * (1 if fp8 else 2))))
    weights = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
               for _ in range(copies)]
    return [quantize_fp8_rowwise(w) for w in weights] if fp8 else weights


def warm_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy for `seconds` (bf16 matmuls) so that its clocks have ramped up from
    idle before the first timing: a sweep's first candidate (the default, in the tune
    scripts) otherwise ran at idle clocks and looked up to 25% slower than the same tiling
    timed later (H200, 2026-12-01)."""
    a = torch.randn((4096, 4096), device="cuda", dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def median_cuda_ms(fn: Any, repeats: int) -> float:
    """The median of `repeats` timed calls of `fn` on the current CUDA stream (CUDA events,
    each call synchronised), after three untimed ones (compiles, allocations)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_time_us(fns: list[Callable[[], Any]], replays: int = 20) -> float:
    """Microseconds per call: `fns` called in turn inside one CUDA graph (after one eager
    round on a side stream: compiles, allocations), the graph replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    # The compile before this call may have left the GPU idle long enough for its clocks to
    # drop: ~10 ms of untimed replays first (in R1 a tiling timed right after its compile took
    # 7.6 us, the same tiling timed again 7.0).
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    for _ in range(min(1000, int(0.01 / max(time.perf_counter() - t0, 1e-6)))):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(fns))


def call_ms(fn: Callable[[], Any], repeats: int, timing: str) -> float:
    """Milliseconds per call of `fn`: "graph" times `repeats` replays of a CUDA graph of it
    (as a decode step runs it: no launcher Python), "events" the median of eager calls."""
    if timing == "graph":
        return graph_time_us([fn], replays=repeats) / 1e3
    return median_cuda_ms(fn, repeats)
