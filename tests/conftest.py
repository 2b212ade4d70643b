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
