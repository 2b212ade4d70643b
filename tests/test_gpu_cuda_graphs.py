"""`kiln.runtime.cuda_graphs.BucketGraphs`: capture per bucket into one pool, replay with padding.

The padding rule is plain tensor code and is checked on CPU; capture and replay need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.graph_inputs import copy_into
from kiln.runtime.cuda_graphs import BucketGraphs, CudaGraphError, capture_seconds_by_kind


def test_copy_padded_fills_what_the_input_leaves():
    buf = torch.full((4, 3), 7, dtype=torch.int32)
    copy_into(buf, torch.ones(2, 2, dtype=torch.int32), 0)
    assert buf.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        copy_into(buf, torch.ones(5, 3, dtype=torch.int32), 0)


def test_capture_seconds_summed_by_kind_with_the_slowest_graph():
    line = capture_seconds_by_kind({"decode-1": 0.05, "decode-64": 0.25, "decode-8": 0.1, "mixed-512": 0.75})
    assert line == "decode 3 graphs 0.40s (slowest decode-64 0.25s), mixed 1 graph 0.75s (slowest mixed-512 0.75s)"
    assert capture_seconds_by_kind({}) == "none"


def test_cpu_device_is_refused():
    with pytest.raises(CudaGraphError, match="CUDA device"):
        BucketGraphs("cpu")


@pytest.mark.gpu
def test_device_without_index_means_the_current_one():
    # Tensors always name their index: a bare "cuda" must compare equal to them.
    assert BucketGraphs("cuda").device == torch.zeros(1, device="cuda").device
    assert BucketGraphs(torch.device("cuda", 0)).device == torch.device("cuda:0")


@pytest.mark.gpu
def test_capture_largest_first_and_replay_each_bucket():
    dev = torch.device("cuda")  # no index, as the engine config gives it
    torch.manual_seed(0)
    w1, w2 = torch.randn(64, 256, device=dev), torch.randn(256, 32, device=dev)
    order: list[int] = []

    def step(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            order.append(x.shape[0])
        h = torch.relu(x @ w1) @ w2
        return h * (lengths[:, None] > 0)  # padded rows (length 0) give zeros

    buckets = {b: {"x": torch.zeros(b, 64, device=dev), "lengths": torch.zeros(b, dtype=torch.int32, device=dev)}
               for b in (1, 2, 4, 8)}
    graphs = BucketGraphs(dev)
    graphs.capture_all({b: step for b in buckets}, buckets)  # one callable per bucket, as the runner has
    assert order == [8, 4, 2, 1]
    for b in buckets:  # each capture's seconds, and their split into phases that add up to them
        phases = graphs.capture_phases[b]
        assert sorted(phases) == ["capture", "sync", "warmup"] and min(phases.values()) >= 0
        assert sum(phases.values()) == pytest.approx(graphs.capture_seconds[b], abs=1e-3)
    for b in (1, 2, 4, 8):
        x = torch.randn(b, 64, device=dev)
        lengths = torch.arange(1, b + 1, dtype=torch.int32, device=dev)
        torch.testing.assert_close(graphs.replay(b, {"x": x, "lengths": lengths}), step(x, lengths))
    # Three rows in the bucket of 4: the fourth is padded with zeros and yields zeros. The
    # expectation runs eagerly at the bucket's shape, so cuBLAS picks the same kernel as in
    # the graph (another row count may sum in another order: float32 noise, not a bug).
    x = torch.randn(3, 64, device=dev)
    out = graphs.replay(4, {"x": x, "lengths": torch.ones(3, dtype=torch.int32, device=dev)})
    padded_x = torch.cat([x, torch.zeros(1, 64, device=dev)])
    padded_lengths = torch.tensor([1, 1, 1, 0], dtype=torch.int32, device=dev)
    torch.testing.assert_close(out, step(padded_x, padded_lengths))
    assert out[3].abs().sum().item() == 0
    with pytest.raises(CudaGraphError, match="no CUDA graph"):
        graphs.replay(16, {"x": x})
