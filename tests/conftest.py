"""Shared fixtures: tiny random models of each supported architecture, saved to disk."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests' own process runs torch on one CPU thread (KILN_TEST_THREADS to change it). Their
# tiny models' ops are far too small to gain from a second thread, and with two, every op
# waits at a thread barrier whenever the other core is busy: a `kiln serve` or worker child,
# .ci/run's background `kiln compile`, anything else on the machine. On a loaded 2-core
# machine Hugging Face's greedy loop of one parity test took 15 s on two threads, 0.6 s on
# one. Subprocesses (servers, cache workers, the CLI) keep torch's default.
torch.set_num_threads(int(os.environ.get("KILN_TEST_THREADS", "1")))

# Engines and pass tests in this process capture each distinct model config once and get
# copies (tests/shared_capture.py says why that is the same graph, and what it saves).
import shared_capture  # noqa: E402  (tests/ is on pythonpath)

shared_capture.install()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Kernel tests that run on whichever device there is (the interpreter on CPU) are GPU
        # tests on a GPU: `pytest -m gpu` must run them there.
        for item in items:
            if "triton_kernels" in item.keywords:
                item.add_marker(pytest.mark.gpu)
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
