"""Python run from the checkout's root (`python -c`, `python -m pytest`, the tests' `python -m
kiln.runtime.cli` subprocesses) puts the root first on sys.path, where the folder `kernels/`
(imported as `kiln.kernels`) has the name of Hugging Face's `kernels` package, which
transformers imports while it builds a model (a dependency from transformers 5.25). The top
of kernels/__init__.py hands such an import over; these run a fresh interpreter there."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_in_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_top_level_kernels_is_never_kilns():
    out = run_in_root("import json, kernels; "
                      "print(json.dumps([kernels.__file__, hasattr(kernels, 'triton_kernels_available')]))")
    assert out.returncode == 0, out.stderr
    path, kilns = json.loads(out.stdout.strip().splitlines()[-1])
    assert not kilns  # Kiln's ops are only ever kiln.kernels
    if hf_kernels_installed():
        assert Path(path).resolve() != ROOT / "kernels" / "__init__.py"  # Hugging Face's own
    else:
        assert Path(path).resolve() == ROOT / "kernels" / "__init__.py"  # an empty stand-in


def test_transformers_builds_a_model_from_the_checkout_root():
    out = run_in_root("import torch, transformers.integrations.hub_kernels; "
                      "from transformers import LlamaConfig, LlamaForCausalLM; "
                      "import kiln.kernels; "
                      "c = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, "
                      "num_attention_heads=2, num_key_value_heads=1, vocab_size=32); "
                      "print(LlamaForCausalLM(c)(torch.tensor([[1, 2]])).logits.shape)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "torch.Size([1, 2, 32])"
