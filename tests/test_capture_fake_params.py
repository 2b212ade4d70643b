"""Capture builds the model's parameters as fake tensors (kiln.compiler.capture): no
parameter memory, yet the same graph as a capture over real parameters, with real buffers."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_config  # noqa: E402

from kiln.compiler import capture as capture_module  # noqa: E402


def test_parameters_are_fake_and_buffers_real() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    hf, _, _ = capture_module._build_for_export(tiny_config("llama"), torch.float32, "cpu")
    params = dict(hf.named_parameters())
    assert params and all(isinstance(p, FakeTensor) for p in params.values())
    buffers = dict(hf.named_buffers())
    assert buffers and not any(isinstance(b, FakeTensor) for b in buffers.values())
    assert torch.isfinite(buffers["model.rotary_emb.inv_freq"]).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_fake_parameters_give_the_graph_of_real_ones(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(arch)
    fake = capture_module.capture(config, torch.float32, "cpu", max_num_tokens=64)
    # The same capture with the parameters left real (what capture did before).
    monkeypatch.setattr(capture_module, "_fake_parameters", lambda mode: contextlib.nullcontext())
    real = capture_module.capture(config, torch.float32, "cpu", max_num_tokens=64)
    assert fake.graph_module.code == real.graph_module.code
    assert fake.param_aliases == real.param_aliases
    assert fake.constants.keys() == real.constants.keys()
    for name, value in fake.constants.items():
        assert not isinstance(value, torch._subclasses.fake_tensor.FakeTensor)
        assert torch.equal(value, real.constants[name])
