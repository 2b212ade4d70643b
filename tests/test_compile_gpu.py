"""The compile cache on CUDA: AOTInductor packages (which some torch builds cannot load) and the
post-pass graph as code (the CUDA default), each with a warm start in a new process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_warm_start import TINY_PROMPTS, TINY_SETTINGS, assert_compiled_nothing, run_worker


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_cold_compile_then_warm_start(tiny_model_dir, tmp_path, dtype):
    """Two buckets compiled by Inductor on the GPU (standalone artifacts) by one process;
    another with empty Inductor and Triton caches loads them, runs no Dynamo and no Inductor
    code generation, compiles no Triton kernel, and generates the same tokens. In float32 the
    compiled engine also matches the eager graph token for token."""
    model = str(tiny_model_dir("llama")[0])
    cache = str(tmp_path / "cache")
    common = {"model": model, "dtype": dtype, "device": "cuda", "cache_dir": cache, **TINY_SETTINGS,
              "prompts": TINY_PROMPTS, "max_tokens": 10}
    cold = run_worker({**common, "compile": "inductor", "check_eager": dtype == "float32"})
    assert cold["mode"] == "inductor" and cold["compiled"] == 2
    if dtype == "float32":
        assert cold["tokens"] == cold["eager_tokens"]
    fresh = tmp_path / "fresh-inductor-cache"
    warm = run_worker({**common, "compile": "inductor", "require_cache": True, "num_kv_blocks": 37},
                      env={"TORCHINDUCTOR_CACHE_DIR": str(fresh), "TRITON_CACHE_DIR": str(tmp_path / "fresh-triton")})
    assert warm["tokens"] == cold["tokens"] and warm["from_cache"] == 2 and not warm["captured"]
    assert warm["counters"].get("frames", {}).get("ok", 0) == 0, warm["counters"]  # no Dynamo
    assert warm["counters"].get("inductor", {}).get("fxgraph_cache_miss", 0) == 0, warm["counters"]  # no codegen
    assert warm["triton_compiled"] == 0, f"{warm['triton']}; compiled: {warm['triton_compiled_names']}"
    # Triton's driver module (cuda_utils) was built during the cold process's Inductor compile,
    # inside Inductor's own Triton folder: the entry carries it all the same, so nothing is built.
    assert warm["triton_modules"] == [], warm["triton_modules"]
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


@pytest.mark.gpu
def test_cuda_cache_from_kiln_compile_serves_a_fresh_machine(tiny_model_dir, tmp_path):
    """CI -> server on the GPU: `kiln compile --device cuda` fills a cache (with Triton and
    Inductor caches of its own); a copy of it on another path, in a process whose Triton and
    Inductor caches are new empty folders, starts with require_cache and compiles nothing of
    any kind - no capture, no Dynamo or Inductor, no Triton kernel or launcher - and generates
    what an eager engine generates."""
    model = str(tiny_model_dir("llama")[0])
    built = tmp_path / "ci-cache"
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.runtime.cli", "compile", "--model", model, "--device", "cuda", "--dtype",
         "float32", "--cache-dir", str(built), "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
         "--buckets", "decode:1", "tokens:16"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "ci-triton"),
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ci-inductor")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "triton-kernels  stored" in proc.stdout, proc.stdout
    served = tmp_path / "served-cache"
    shutil.copytree(built, served)
    common = {"model": model, "dtype": "float32", "device": "cuda", **TINY_SETTINGS, "prompts": TINY_PROMPTS,
              "max_tokens": 10}
    fresh_inductor, fresh_triton = tmp_path / "fresh-inductor", tmp_path / "fresh-triton"
    warm = run_worker({**common, "cache_dir": str(served), "require_cache": True},
                      env={"TORCHINDUCTOR_CACHE_DIR": str(fresh_inductor), "TRITON_CACHE_DIR": str(fresh_triton)})
    assert warm["mode"] == "graph"
    assert_compiled_nothing(warm, fresh_inductor)
    assert warm["triton"].startswith("Triton kernels from the cache"), warm["triton"]
    assert (warm["triton_compiled"], warm["triton_modules_built"]) == (0, 0), (
        f"{warm['triton']}; compiled after start-up: {warm['triton_compiled_names']}, modules {warm['triton_modules']}")
    eager = run_worker({**common, "compile": "eager"}, env={"TRITON_CACHE_DIR": str(tmp_path / "eager-triton")})
    assert eager["triton_compiled"] > 0  # the detector does fire where kernels are compiled
    assert warm["tokens"] == eager["tokens"]
    print(f"warm start from a copied cache: {warm['triton']}; first token {warm['first_token_seconds']:.2f}s "
          f"after process start")
