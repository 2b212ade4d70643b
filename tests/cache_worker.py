"""A fresh process for the compile-cache tests: start an engine, generate, report as JSON.

Run as `python cache_worker.py '<json options>'`; the last stdout line is `RESULT: {...}`.
A separate process is the point: whether a start-up compiled anything is read from torch's
process-wide compile counters and compile-event timings, which must start at zero.

Options: model, dtype, device, cache_dir, compile, require_cache, max_num_seqs, max_num_batched_tokens,
decode_buckets, token_buckets, prompts (token-id lists or strings), max_tokens, and
check_eager (after the compiled run, capture the graph and run the same engine eagerly over
the same weights, to compare tokens).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash inside a compiled artifact still shows where it happened
    opts = json.loads(sys.argv[1])
    t_start = time.perf_counter()
    from torch._dynamo.utils import compilation_time_metrics, counters

    from kiln.compiler.triton_kernels import count_triton_compiles
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    triton_count = count_triton_compiles()
    triton = triton_count.__enter__()  # over the engine's start-up and both generate calls
    t_engine = time.perf_counter()
    llm = LLM(
        opts.get("model"), dtype=opts.get("dtype", "auto"), device=opts.get("device", "auto"),
        compile=opts.get("compile", "auto"), cache_dir=opts.get("cache_dir"),
        require_cache=opts.get("require_cache", False), max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"], decode_buckets=opts.get("decode_buckets"),
        token_buckets=opts.get("token_buckets"), num_kv_blocks=opts.get("num_kv_blocks", 64),
        enable_prefix_caching=False, progress=False,
    )
    params = SamplingParams(max_tokens=opts.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    prompts = opts["prompts"]
    first = llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    now = time.perf_counter()
    first_token_seconds = now - t_start  # from process start, imports included
    engine_first_token_seconds = now - t_engine  # from LLM(...) to the first token
    outs = llm.generate(prompts, params)
    triton_count.__exit__(None, None, None)
    engine = llm.engine
    report = engine.startup_report
    result = {
        "first_token": first[0].outputs[0].token_ids,
        "first_token_seconds": first_token_seconds,
        "engine_first_token_seconds": engine_first_token_seconds,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "mode": report.mode,
        "from_cache": report.num_from_cache,
        "compiled": report.num_compiled,
        "captured": report.captured,
        "graph_from_cache": report.graph_from_cache,
        "dropped": report.dropped,
        "buckets": {r.bucket.name: [r.status, round(r.seconds, 2)] for r in report.buckets},
        "timings": engine.timings,
        "bucket_counts": engine.runner.bucket_counts,
        # Read before anything below (the eager check captures) can add to them.
        "counters": {k: {kk: vv for kk, vv in v.items()} for k, v in counters.items() if v},
        "compile_events": sorted(compilation_time_metrics),
        "triton": report.triton,
        "triton_compiled": triton.compiled,
        "triton_modules_built": triton.modules_built,
        "triton_compiled_names": triton.names,
        "triton_modules": triton.modules,
        "model_config_type": type(engine.model_config).__name__,
        # transformers' per-model config modules (which can pull in torch._dynamo) and Dynamo itself
        "transformers_config_modules": sorted(m for m in sys.modules if m.startswith("transformers.models.")
                                              and ".configuration_" in m),
    }
    if opts.get("check_eager"):
        from kiln.compiler.pipeline import build_model_graph
        from kiln.passes.manager import PassManager

        graph = build_model_graph(engine.model_config, engine.dtype, engine.device,
                                  block_size=engine.config.block_size, pass_manager=PassManager.default(),
                                  max_num_tokens=engine.config.max_num_batched_tokens)
        engine.runner = engine.runner.twin(graph.graph_module, graph.input_roles())
        result["eager_tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    print("RESULT: " + json.dumps(result))


if __name__ == "__main__":
    main()
