"""Every supported architecture with the fusion passes forced on (the CUDA pipeline, run on
CPU with the kernels' plain-torch references): the fused graph must still match Hugging
Face, and the fusions that fire must be those the README's support table lists.

Where a fusion's pattern is absent (partial or interleaved rotary, Gemma's (1+w) RMSNorm,
LayerNorm models, GELU MLPs) the pass must leave the graph alone, and where it fires it
must compute the same thing: both show up as a logits mismatch here.
"""

from __future__ import annotations

import pytest

from support_table import README, fusions_fired, parse_rows, readme_table
from test_parity import PROMPTS, assert_first_step_logits_match
from tiny_models import SUPPORTED

from kiln.passes.fuse_common import CPU_FUSIONS_ENV
from kiln.runtime import LLM


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
