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


# CI runs the suite on two xdist workers with `--dist loadgroup --no-loadscope-reorder`
# (.ci/run): each xdist group runs on one worker, and the groups are handed out in the order
# of the collected items. A test file is its own group, except these, which share one:
# files whose tests build engines of the same tiny checkpoints, so that one worker captures
# each model once for all of them (tests/shared_capture.py).
XDIST_GROUPS = {"tests/test_parity.py": "tiny-archs", "tests/test_fusions_per_arch.py": "tiny-archs"}
# The longest groups (wall time on the 2-core CI machine), longest first; every other file
# follows in collection order. Handing out the long ones first keeps a worker from starting
# one while the other is nearly done. test_warm_start.py is not first: one of its tests waits
# for .ci/run's background `kiln compile` (~3 minutes).
LONGEST_FIRST = [
    "tests/test_shard_tensor_parallel.py", "tiny-archs", "tests/test_fp8.py", "tests/test_kernels_triton.py",
    "tests/test_warm_start.py", "tests/test_tensor_parallel.py", "tests/test_compile_cli.py",
    "tests/test_cache_repair.py", "tests/test_server_hardening.py", "tests/test_server_api.py",
    "tests/test_example_pass.py", "tests/test_runtime_cli_generate.py", "tests/test_pass_guide.py",
    "tests/test_compile_standalone.py", "tests/test_moe.py", "tests/test_server_errors.py",
    "tests/test_runtime_block_manager.py",
]


def _group_and_order(items: list[pytest.Item]) -> None:
    """Give each test its file's xdist group (or XDIST_GROUPS's), and put LONGEST_FIRST first."""
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    groups = {}
    for item in items:
        marks = [m for m in item.iter_markers("xdist_group")]
        if marks:
            groups[item] = str(marks[0].args[0] if marks[0].args else marks[0].kwargs.get("name", "default"))
            continue
        path = item.nodeid.split("::")[0]
        groups[item] = XDIST_GROUPS.get(path, path)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    items.sort(key=lambda item: rank.get(groups[item], len(rank)))  # stable: a file's tests stay in order


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count; before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    _group_and_order(items)
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
