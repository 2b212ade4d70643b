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


# Test files that capture every tiny architecture (float32, CPU): with `--dist loadfile`
# (the README's test command) they go to one pytest-xdist worker together, as one unit, so
# that the worker captures and saves each tiny model once for all three (its memo above and
# the session's `tiny_model_dir`), not each file on whichever worker it lands. Apart they
# took 595 s of test time in one CI run (2026-12-06), each making its own ~1 s capture of
# every tiny model (and the first two its saved checkpoint); together, in one process on an
# idle core, 360 s (before the two-rank test captured at the engines' token budget, and so
# shared them too).
PER_ARCHITECTURE_FILES = ("test_fusions_per_arch.py", "test_parity.py", "test_shard_tensor_parallel.py")


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    class CaptureSharingScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "per-architecture files" if file.rsplit("/", 1)[-1] in PER_ARCHITECTURE_FILES else file

    return CaptureSharingScheduling(config, log)


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
