"""Every supported architecture with the fusion passes forced on (the CUDA pipeline, run on
CPU with the kernels' plain-torch references): the fused graph must still match Hugging
Face, and the fusions that fire must be those the README's support table lists.

Where a fusion's pattern is absent (partial or interleaved rotary, Gemma's (1+w) RMSNorm,
LayerNorm models, GELU MLPs) the pass must leave the graph alone, and where it fires it
must compute the same thing: both show up as a logits mismatch here.

The fusion passes build their RoPE and LayerNorm patterns per pass instance, for the
model's head_dim or hidden size, and every engine has new instances: tracing those patterns
(`torch.export`, 14 times) was half of each engine's start here. The architectures share a
few sizes, so within this module the patterns of a size are built and traced once (the
first engine of that size) and the later engines reuse them, as one engine's passes reuse
theirs: the same graphs, matched and rewritten in every architecture's model as before.
"""

from __future__ import annotations

import functools

import pytest

from support_table import README, fusions_fired, parse_rows, readme_table
from test_parity import PROMPTS, assert_first_step_logits_match
from tiny_models import SUPPORTED

from kiln.passes.fuse_common import CPU_FUSIONS_ENV
from kiln.runtime import LLM


@pytest.fixture(scope="module", autouse=True)
def patterns_built_once_per_size():
    from kiln.passes import fuse_layernorm, fuse_rope

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuse_rope, "rope_patterns", functools.cache(fuse_rope.rope_patterns))
        mp.setattr(fuse_layernorm, "layer_norm_patterns", functools.cache(fuse_layernorm.layer_norm_patterns))
        yield


@pytest.fixture(scope="module")
def readme_fusions() -> dict[str, str]:
    return {r.arch: r.fusions for r in parse_rows(readme_table(README.read_text()))}


@pytest.mark.parametrize("arch", SUPPORTED)
def test_fused_graph_matches_hf(arch: str, tiny_model_dir, monkeypatch, readme_fusions) -> None:
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    path, hf = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    assert_first_step_logits_match(llm, hf, PROMPTS, f"{arch} with fusions")
    fired = ", ".join(fusions_fired(llm.engine.graph_spec.pass_records)) or "-"
    assert fired == readme_fusions.get(arch), (
        f"{arch}: fusions fired ({fired}) differ from README's support table ({readme_fusions.get(arch)}); "
        "regenerate it with tests/support_table.py --write")
