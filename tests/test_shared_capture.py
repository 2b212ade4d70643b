"""The tests' capture memo (tests/shared_capture.py): its copies behave as fresh captures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kiln.compiler import capture as capture_module
from kiln.compiler import pass_testing, pipeline
from kiln.compiler.pass_testing import capture_through, run_graph

sys.path.insert(0, str(Path(__file__).parent))
import shared_capture  # noqa: E402
from tiny_models import tiny_config  # noqa: E402


def _stats(phase_capture: pass_testing.PhaseCapture) -> list[tuple[str, dict]]:
    return [(r.name, r.stats) for r in phase_capture.report.records]


@pytest.mark.skipif(not shared_capture.enabled(), reason="KILN_TEST_SHARE_CAPTURES=0: nothing is shared")
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_shared_copy_runs_the_pipeline_as_a_fresh_capture(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # conftest routes the engine's and the pass helpers' captures through the memo.
    assert pass_testing.capture is shared_capture.shared_capture
    assert pipeline.capture is shared_capture.shared_capture
    config = tiny_config(arch)
    first = capture_through(config, "logits", inclusive=True)
    # The pipeline rewrote the first copy in place; the second starts from the pristine graph,
    # so the same passes give the same graph (a shared graph would have been rewritten twice).
    second = capture_through(config, "logits", inclusive=True)
    monkeypatch.setattr(pass_testing, "capture", capture_module.capture)
    fresh = capture_through(config, "logits", inclusive=True)
    assert first.graph_module is not second.graph_module
    assert first.graph_module.code == second.graph_module.code == fresh.graph_module.code
    assert _stats(first) == _stats(second) == _stats(fresh)
    assert first.captured.param_aliases == fresh.captured.param_aliases
    assert first.config is config  # the caller's own config object, as a capture carries
    assert torch.equal(run_graph(first), run_graph(fresh))
    assert torch.equal(run_graph(second), run_graph(fresh))


def test_a_patched_capture_function_is_not_served_from_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    # A test that patches a function of kiln.compiler.capture gets a capture made with it.
    config = tiny_config("llama")
    shared_capture.shared_capture(config)
    calls = []
    real = capture_module.capture

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_module, "capture", counting)
    shared_capture.shared_capture(config)
    assert calls == [1]
