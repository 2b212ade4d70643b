"""Tensor parallelism on GPUs: the collective ops captured inside a CUDA graph (a one-GPU
process group), and, where two GPUs exist, TP=2 over NCCL: the one-shot all-reduce inside a
CUDA graph, greedy and seeded tokens of TP=1, a killed worker failing the engine naming its
rank, `kiln serve -tp 2` answering the openai client, FP8 weights and KV cache at TP=2.
CPU versions of the TP=2 tests: tests/test_tensor_parallel.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _collectives_in_cuda_graph(init_file: str) -> None:
    import torch.distributed as dist

    import kiln.kernels  # noqa: F401  (registers kiln::all_reduce, kiln::all_gather)

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        x = torch.ones(8, 4096, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (NCCL's communicator)
            torch.ops.kiln.all_reduce(x)
            torch.ops.kiln.all_gather(x, -1, 1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            reduced = torch.ops.kiln.all_reduce(x * 2)
            gathered = torch.ops.kiln.all_gather(x + 1, -1, 1)
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(reduced, torch.full_like(x, 6.0))  # the replay read the new x
        assert torch.equal(gathered, torch.full_like(x, 4.0))
    finally:
        dist.destroy_process_group()


@needs_cuda
def test_collectives_captured_in_a_cuda_graph(tmp_path: Path) -> None:
    import multiprocessing

    # Its own process: the process group must not leak into the other tests.
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_collectives_in_cuda_graph, args=(str(tmp_path / "init"),))
    p.start()
    p.join(300)
    assert p.exitcode == 0


def _one_shot_rank(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    from kiln.kernels import collectives

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2, device_id=device)
    try:
        one_shot = collectives.enable_one_shot_all_reduce(torch.bfloat16, device, max_bytes=2**20)
        assert one_shot is not None  # the H200 pairs have peer access: it must come up
        small = torch.full((4, 4096), float(rank + 1), device=device, dtype=torch.bfloat16)
        large = torch.full((2**20,), float(rank + 1), device=device, dtype=torch.bfloat16)  # 2 MiB: NCCL
        assert one_shot.takes(small) and not one_shot.takes(large)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.ops.kiln.all_reduce(small)
            torch.ops.kiln.all_reduce(large)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # two one-shot calls in a row reuse the one buffer
            a = torch.ops.kiln.all_reduce(small)
            b = torch.ops.kiln.all_reduce(small * 2)
            c = torch.ops.kiln.all_reduce(large)
        for step in range(3):  # replays read the new inputs
            small.fill_(float((rank + 1) * (step + 1)))
            large.fill_(float(rank + step))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(a, torch.full_like(small, 3.0 * (step + 1)))
            assert torch.equal(b, torch.full_like(small, 6.0 * (step + 1)))
            assert torch.equal(c, torch.full_like(large, 1.0 + 2 * step))
    finally:
        collectives.disable_one_shot_all_reduce()
    dist.destroy_process_group()  # not after a failure: it would wait for the peer


@needs_two
def test_one_shot_all_reduce_two_gpus_in_a_cuda_graph(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    # A rank that fails leaves its peer spinning at the kernel's barrier: fail on a deadline
    # (killing both) rather than hang the suite.
    context = mp.start_processes(_one_shot_rank, args=(str(tmp_path / "init"),), nprocs=2, start_method="spawn",
                                 join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail("the one-shot all-reduce test did not finish in 120 s (a rank is stuck at a barrier)")


@needs_two
@pytest.mark.parametrize("arch", ["llama", "llama-kv1", "qwen3", "mixtral"])
def test_tp2_nccl_greedy_tokens_match_tp1(arch: str, tmp_path: Path) -> None:
    from test_tensor_parallel import GREEDY, OPTIONS, PROMPTS, _save, _tokens

    from kiln.runtime.llm import LLM

    model = str(_save(arch, tmp_path / arch))
    # float32: bf16 sums in another order (the all-reduce) may flip a near-tie.
    options = dict(OPTIONS, dtype="float32", gpu_memory_utilization=0.3)
    from kiln.runtime.sampling_params import SamplingParams

    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234)
    tp1 = LLM(model, **options)
    expected = _tokens(tp1.generate(PROMPTS, GREEDY))
    expected_seeded = _tokens(tp1.generate(PROMPTS, seeded))
    del tp1
    torch.cuda.empty_cache()
    llm = LLM(model, tensor_parallel_size=2, **options)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
        # The engine draws on rank 0's GPU (logits shared by CUDA IPC), as TP=1 draws on its own.
        assert llm.engine.executor._device_logits is not None
        assert _tokens(llm.generate(PROMPTS, seeded)) == expected_seeded
        assert [r["device"] for r in llm.engine.executor.reports] == ["cuda:0", "cuda:1"]
        assert all(r["memory"]["device_peak_bytes"] > 0 for r in llm.engine.executor.reports)
    finally:
        llm.engine.shutdown()


@needs_two
def test_tp2_nccl_fp8_weights_and_kv_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """FP8 weights (quantized at load, or a pre-quantized checkpoint's slices) and an FP8 KV
    cache calibrated per rank, at TP=2 on two GPUs: tests/test_tensor_parallel.py's check."""
    from test_tensor_parallel import OPTIONS, assert_fp8_runs_at_tp2

    assert_fp8_runs_at_tp2(tmp_path, caplog, **dict(OPTIONS, gpu_memory_utilization=0.3))


@needs_two
def test_tp2_one_shot_all_reduce_greedy_tokens_match_tp1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_tensor_parallel import GREEDY, OPTIONS, PROMPTS, _save, _tokens

    from kiln.runtime.llm import LLM

    model = str(_save("llama", tmp_path / "llama"))
    options = dict(OPTIONS, dtype="float32", gpu_memory_utilization=0.3)
    tp1 = LLM(model, **options)
    expected = _tokens(tp1.generate(PROMPTS, GREEDY))
    del tp1
    torch.cuda.empty_cache()
    monkeypatch.setenv("KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES", str(4 * 2**20))  # the workers inherit it
    llm = LLM(model, tensor_parallel_size=2, **options)
    try:
        assert all(r["one_shot_all_reduce_max_bytes"] == 4 * 2**20 for r in llm.engine.executor.reports)
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    finally:
        llm.engine.shutdown()


@needs_two
def test_tp2_nccl_killed_worker(tmp_path: Path) -> None:
    from test_tensor_parallel import GREEDY, OPTIONS, PROMPTS, _all_exit, _save

    from kiln.runtime.llm import LLM
    from kiln.runtime.tp_worker import WorkerFailedError

    llm = LLM(str(_save("llama", tmp_path / "llama")), tensor_parallel_size=2, gpu_memory_utilization=0.3, **OPTIONS)
    pids = llm.engine.executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - t0 < 60
    assert _all_exit(pids, within_s=15)


@needs_two
def test_serve_tp2_nccl_openai_client(tmp_path_factory: pytest.TempPathFactory) -> None:
    import openai
    from runtime_text_model import text_model_dir
    from server_process import start_server

    model = str(text_model_dir(tmp_path_factory))
    server = start_server(model, "-tp", "2", "--max-model-len", "128", "--max-num-seqs", "8",
                          "--gpu-memory-utilization", "0.3")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        done = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 6
    finally:
        server.stop()
