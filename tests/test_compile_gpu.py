"""The compile cache on CUDA: AOTInductor packages (which some torch builds cannot load) and the
post-pass graph as code (the CUDA default), each with a warm start in a new process."""

from __future__ import annotations

import pytest

from test_warm_start import TINY_PROMPTS, TINY_SETTINGS, assert_compiled_nothing, run_worker


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_cold_compile_then_warm_start(cuda_aoti_packages_load, tiny_model_dir, tmp_path, dtype):
    """Two buckets compiled on the GPU by one process; another process with an empty Inductor
    cache loads them, compiles nothing, and generates the same tokens. In float32 the compiled
    engine also matches the eager graph token for token."""
    model = str(tiny_model_dir("llama")[0])
    cache = str(tmp_path / "cache")
    common = {"model": model, "dtype": dtype, "device": "cuda", "cache_dir": cache, **TINY_SETTINGS,
              "prompts": TINY_PROMPTS, "max_tokens": 10}
    cold = run_worker({**common, "compile": "inductor", "check_eager": dtype == "float32"})
    assert cold["mode"] == "inductor" and cold["compiled"] == 2
    if dtype == "float32":
        assert cold["tokens"] == cold["eager_tokens"]
    fresh = tmp_path / "fresh-inductor-cache"
    # compile="inductor": on CUDA, "auto" with a cache means the graph-code artifact.
    warm = run_worker({**common, "compile": "inductor", "require_cache": True},
                      env={"TORCHINDUCTOR_CACHE_DIR": str(fresh), "TRITON_CACHE_DIR": str(tmp_path / "fresh-triton")})
    assert warm["tokens"] == cold["tokens"] and warm["from_cache"] == 2
    assert_compiled_nothing(warm, fresh)
    print(f"cuda {dtype}: compile {cold['buckets']}, warm first token {warm['engine_first_token_seconds']:.2f}s")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_mode_cold_then_warm_start(tiny_model_dir, tmp_path, dtype):
    """The CUDA default with a cache (compile mode "graph"): one process captures and stores
    the post-pass graph; a fresh one loads it, captures nothing, and generates the same tokens."""
    model = str(tiny_model_dir("llama")[0])
    common = {"model": model, "dtype": dtype, "device": "cuda", "cache_dir": str(tmp_path / "cache"),
              **TINY_SETTINGS, "prompts": TINY_PROMPTS, "max_tokens": 10}
    cold = run_worker(common)  # compile="auto" with a cache on CUDA -> "graph"
    assert cold["mode"] == "graph" and cold["captured"]
    warm = run_worker({**common, "require_cache": True})
    assert warm["mode"] == "graph" and not warm["captured"] and warm["graph_from_cache"]
    assert "graph capture" not in warm["timings"]
    assert warm["tokens"] == cold["tokens"]
