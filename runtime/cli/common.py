"""Options shared by every `kiln` command that builds an engine (generate, chat, serve, compile)."""

from __future__ import annotations

import argparse
import logging
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False, serving: bool = True) -> None:
    """The engine's options; `serving=False` (kiln compile) leaves out those that only matter
    when an engine runs (--compile, --require-cache)."""
    g = parser.add_argument_group("model and engine")
    if model_positional:
        g.add_argument("model", nargs="?", default=None,
                       help="Hugging Face directory, .gguf file or config.json (default: SmolLM2-135M-Instruct GGUF)")
    else:
        g.add_argument("--model", "-m", default=None,
                       help="Hugging Face directory, .gguf file or config.json (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default="auto", help="cpu | cuda | auto (CUDA when available)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="'dummy' uses deterministic random weights (benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable reuse of cached prompt prefixes")
    g.add_argument("--enable-pass", action="append", default=[], metavar="NAME", help="turn on an optional pass")
    g.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="turn off a pass")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory for weights, activations and the KV cache (default 0.9)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps without capturing CUDA graphs")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read every step's tokens back before scheduling the next (default: the next "
                        "decode step is launched first, overlapping the host's work with the device's)")
    g.add_argument("--verbose", "-v", action="store_true", help="log start-up phases and more")
    add_cache_args(parser, serving)


def add_cache_args(parser: argparse.ArgumentParser, serving: bool = True) -> None:
    """Compile-cache options (kiln.compiler.aot): where the cache is, the bucket plan, and
    for engines whether to compile at all and whether a miss is an error."""
    c = parser.add_argument_group("compile cache")
    c.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="compile cache directory (default: $KILN_CACHE_DIR or ~/.cache/kiln)")
    c.add_argument("--buckets", nargs="+", default=[], metavar="KIND:N,N",
                   help="bucket sizes instead of the default plan, e.g. --buckets decode:1,2,4 tokens:64,256")
    if serving:
        c.add_argument("--compile", default="auto", choices=["auto", "eager", "inductor", "graph"],
                       help="auto: use the device's cached artifact (CPU: Inductor packages; CUDA: the post-pass "
                            "graph as code) when the cache holds it all, fill misses only with --cache-dir or "
                            "--require-cache, else run eagerly; eager: run the FX graph directly, compiling "
                            "nothing; inductor: compile what is missing; graph: cache the post-pass FX graph")
        c.add_argument("--require-cache", action="store_true",
                       help="fail at start-up, naming the missing buckets, instead of compiling (see `kiln compile`)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
        enable_passes=args.enable_pass, disable_passes=args.disable_pass,
        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=not args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        **cache_kwargs(args),
    )


def cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.compiler.buckets import parse_bucket_spec

    decode, tokens = parse_bucket_spec(getattr(args, "buckets", []) or [])
    out: dict[str, Any] = dict(cache_dir=getattr(args, "cache_dir", None), decode_buckets=decode,
                               token_buckets=tokens)
    if hasattr(args, "compile"):
        out.update(compile=args.compile, require_cache=args.require_cache)
    return out


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Start-up phase timings are always worth showing on stderr.
    logging.getLogger("kiln").setLevel(logging.INFO)
