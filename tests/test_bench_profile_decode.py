"""bench/profile_decode.py's kernel tables from profiler events (no GPU: synthetic spans).

Under programmatic dependent launch a kernel is recorded from the launch of its programs,
which first wait for the kernel before: recorded durations overlap. The exclusive time
(what no earlier kernel overlapped) and the idle gaps must add up to the step's span.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench_scripts import load_bench_script


def _profile_decode(monkeypatch):
    return load_bench_script(monkeypatch, "profile_decode")


class FakeProfile:
    def __init__(self, spans: list[tuple[float, float, str]]):
        self.spans = spans

    def events(self):
        cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
        device = [SimpleNamespace(time_range=SimpleNamespace(start=s, end=e), name=n, device_type=cuda,
                                  device_time=e - s) for s, e, n in self.spans]
        return device + [SimpleNamespace(time_range=SimpleNamespace(start=0, end=99), name="host", device_type=cpu,
                                         device_time=0)]


def test_exclusive_kernel_time_and_gaps_add_up_to_the_span(monkeypatch):
    pd = _profile_decode(monkeypatch)
    # Two steps: a GEMV, a norm launched early (PDL) that overlaps its last 2 us, a GEMV
    # launched early too, then 5 us idle and RoPE.
    step = [(0, 10, "gemv"), (8, 15, "norm"), (14, 20, "gemv"), (25, 30, "rope")]
    prof = FakeProfile(step + [(s + 30, e + 30, n) for s, e, n in step])
    table = {row["kernel"]: row for row in pd._kernel_table(prof, steps=2)}
    assert table["gemv"]["us_per_step"] == 16 and table["gemv"]["exclusive_us_per_step"] == 15
    assert table["norm"]["us_per_step"] == 7 and table["norm"]["exclusive_us_per_step"] == 5
    assert table["rope"]["exclusive_us_per_step"] == 5 and table["gemv"]["launches_per_step"] == 2
    gaps = pd._gap_table(prof, steps=2)
    exclusive = sum(row["exclusive_us_per_step"] for row in table.values())
    assert gaps["span_us_per_step"] == exclusive + gaps["gap_us_per_step"] == 30
    assert [k["kernel"] for k in pd._kernel_table(prof, steps=2)] == ["gemv", "norm", "rope"]
