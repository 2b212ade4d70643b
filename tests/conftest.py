"""Shared fixtures: tiny random models of each supported architecture, saved to disk."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch) -> (path, hf_model), built once per architecture."""
    from tiny_models import save_tiny_model

    made: dict[str, tuple] = {}

    def make(arch: str = "llama"):
        if arch not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[arch] = (path, save_tiny_model(arch, path))
        return made[arch]

    return make


# Compile and load a one-matmul AOTInductor package for CUDA in a fresh process: on some
# torch builds (compiler/README.md, "Compile and cache") loading *any* CUDA package
# segfaults, Kiln or not; tests that load CUDA packages are then skipped with that reason.
_AOTI_CUDA_SMOKE = """
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


@pytest.fixture(scope="session")
def cuda_aoti_packages_load():
    """Skips the test unless this torch build loads AOTInductor CUDA packages, probed in a
    child process: a build that cannot segfaults, which must never take the test run down."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _AOTI_CUDA_SMOKE], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"this torch build ({torch.__version__}) cannot load AOTInductor CUDA packages at all "
                    f"(a one-matmul package exits with status {proc.returncode}); nothing Kiln-specific to test")
