"""The compile cache on CUDA: AOTInductor packages (which some torch builds cannot load) and the
post-pass graph as code (the CUDA default), each with a warm start in a new process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_warm_start import TINY_PROMPTS, TINY_SETTINGS, assert_compiled_nothing, run_worker

# Compile and load a one-matmul AOTInductor package for CUDA in a fresh process: on some
# torch builds (compiler/README.md, "Compile and cache") loading *any* CUDA package
# segfaults, Kiln or not; the test below is then skipped with that reason.
_SMOKE = """
import torch, tempfile, os
class M(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)
args = (torch.randn(4, 8, device="cuda"), torch.randn(8, 8, device="cuda"))
path = os.path.join(tempfile.mkdtemp(), "smoke.pt2")
torch._inductor.aoti_compile_and_package(torch.export.export(M(), args), package_path=path)
torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, 0)
print("ok")
"""


@pytest.fixture(scope="module")
def cuda_packages_load():
    proc = subprocess.run([sys.executable, "-c", _SMOKE], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        import torch

        pytest.skip(f"this torch build ({torch.__version__}) cannot load AOTInductor CUDA packages at all "
                    f"(a one-matmul package exits with status {proc.returncode}); nothing Kiln-specific to test")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_cold_compile_then_warm_start(cuda_packages_load, tiny_model_dir, tmp_path, dtype):
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
