"""Tensor parallelism end to end on CPU (gloo): TP=2 engines give TP=1's greedy tokens
through `LLM.generate` and through `kiln serve` with the `openai` client; `kiln compile -tp 2`
fills every rank's cache entries; FP8 weights and an FP8 KV cache (quantized at load or
pre-quantized) run at TP=2; a killed worker fails the engine naming its rank (503 and an
unhealthy /health from the server) and leaves no worker process behind.

The architectures (`TP_ARCHS` and Llama) are one per construct the sharding pass handles,
each as a tiny random checkpoint on disk, among them a Llama with one KV head, fewer than
the two ranks (the head is replicated)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.tp_executor import MultiprocExecutor
from kiln.runtime.tp_worker import WorkerFailedError

sys.path.insert(0, str(Path(__file__).parent))
from runtime_text_model import text_model_dir  # noqa: E402
from server_process import start_server  # noqa: E402
from tiny_models import save_tiny_model, tiny_config  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 7, 21, 60], [1, 100, 4], [1, 77, 3, 3, 90, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
# Small engines: the default 64 sequences x 8192 tokens of KV cache per rank is much more
# than these tests need on a 2-core machine.
OPTIONS = dict(progress=False, max_model_len=128, max_num_seqs=8)
# Engine-level runs for one architecture of each construct the pass handles (the runtime path
# is the same for all; tests/test_shard_tensor_parallel.py checks every architecture's graph
# at two ranks): plain GQA (Llama, below, with seeded sampling and a killed worker on the same
# engines), KV heads replicated, biases, q/k norm over all heads (an all-reduced mean of
# squares), MoE experts, a parallel block with a row-parallel bias, soft-capping, fused
# q/k/v and gate/up checkpoint tensors, ALiBi with a view that spells out the head count,
# GPT-2's Conv1D (addmm over [in, out] weights, the checkpoint sliced by columns and rows),
# an MoE router of another kind whose selection bias each worker must read from the checkpoint
# (GLM-4.5: a random bias there, zero in a model built from the config).
TP_ARCHS = ["llama-kv1", "qwen2", "olmo2", "mixtral", "phi", "gemma2", "phi3", "bloom", "gpt2", "glm4_moe",
            "deepseek_v3", "llama4_text", "gemma4_e2b"]


def _save(arch: str, path: Path) -> Path:
    if arch == "llama-kv1":
        from transformers import AutoModelForCausalLM
        import torch

        config = tiny_config("llama")
        config.num_key_value_heads = 1
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
        model.save_pretrained(path)
    else:
        save_tiny_model(arch, path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _all_exit(pids: list[int], within_s: float) -> bool:
    """Whether every process in `pids` has exited (or is a zombie) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_greedy_tokens_match_tp1(arch: str, tmp_path: Path) -> None:
    model = str(_save(arch, tmp_path / arch))
    expected = _tokens(LLM(model, **OPTIONS).generate(PROMPTS, GREEDY))
    llm = LLM(model, tensor_parallel_size=2, **OPTIONS)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    finally:
        llm.engine.shutdown()


def test_fp8_weights_and_kv_cache_at_tp2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert_fp8_runs_at_tp2(tmp_path, caplog, **OPTIONS)


def assert_fp8_runs_at_tp2(tmp_path: Path, caplog: pytest.LogCaptureFixture, **options: Any) -> None:
    """FP8 at TP=2 (here on CPU over gloo; tests/test_gpu_tensor_parallel.py on two GPUs):
    `quantization="fp8"` with an FP8 KV cache (each rank quantizes the slices it reads as they
    load, and calibrates the scales of the K/V heads it holds), and a pre-quantized checkpoint
    (each rank reads its slices of the e4m3 values and of their scales, which tests/test_fp8.py
    checks exactly). A rank's quantization is not TP=1's (a cut across the input dimension, like
    each rank's activations and K/V heads, has maxima of its own), so the check is the FP8
    tests' own: teacher-forced greedy agreement with the unquantized TP=1 engine, the 70% they
    ask of TP=1 FP8 (a tiny random model's logits are near-ties)."""
    import gc
    import logging

    import test_fp8
    import torch

    model = _save("llama", tmp_path / "llama")
    reference = test_fp8._tokens(LLM(str(model), **options))  # unquantized, TP=1
    if torch.cuda.is_available():  # that engine's memory back, for rank 0 on the same GPU
        gc.collect()
        torch.cuda.empty_cache()
    prequantized = tmp_path / "ct-channel"
    test_fp8.save_fp8_checkpoint(model, prequantized, "ct-channel")
    for path, fp8 in ((model, dict(quantization="fp8", kv_cache_dtype="fp8")), (prequantized, {})):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kiln.runtime"):
            llm = LLM(str(path), tensor_parallel_size=2, **fp8, **options)
        try:
            assert llm.engine.quantization == "fp8"
            for report in llm.engine.executor.reports:  # each rank's graph: merged q/k/v and gate/up in FP8
                stats = {r["name"]: r["stats"] for r in report["pass_records"]}
                assert stats["quantize_fp8"]["fp8_linear"] == 8, (report["rank"], stats["quantize_fp8"])
            rate = test_fp8.teacher_forced_agreement(llm, reference)
        finally:
            llm.engine.shutdown()
        calibrated = [m for m in caplog.messages if m.startswith("tensor-parallel rank") and "calibrated on" in m]
        assert len(calibrated) == (2 if fp8 else 0), caplog.messages
        print(f"{path.name}: teacher-forced greedy agreement with the unquantized model at TP=2: {rate:.1%}")
        assert rate >= 0.7, (path.name, rate)


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=8)
ENGINE_SEED = 7


@pytest.fixture(scope="module")
def llama_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, list[list[int]]], LLM]]:
    """TP=1's and TP=2's tokens for the Llama checkpoint, and the TP=2 engine that the Llama
    tests share (an engine pair costs more than the checks); the killed-worker test runs last
    on it. Both engines have the engine-level `seed=`, and each one's first generate draws
    unseeded samples ("unseeded", "unseeded_tp2"): the engine seed makes those repeatable
    from a fresh engine, so both engines start from the same state (greedy requests and
    requests with their own seed do not depend on it)."""
    model = str(_save("llama", tmp_path_factory.mktemp("llama") / "llama"))
    tp1 = LLM(model, seed=ENGINE_SEED, **OPTIONS)
    tokens = {"unseeded": _tokens(tp1.generate(PROMPTS, UNSEEDED))}
    tokens |= {"greedy": _tokens(tp1.generate(PROMPTS, GREEDY)), "seeded": _tokens(tp1.generate(PROMPTS, SEEDED))}
    llm = LLM(model, tensor_parallel_size=2, seed=ENGINE_SEED, **OPTIONS)
    try:
        tokens["unseeded_tp2"] = _tokens(llm.generate(PROMPTS, UNSEEDED))
        yield tokens, llm
    finally:
        llm.engine.shutdown()


def test_llama_tp2_greedy_tokens_match_tp1(llama_engines: tuple[dict[str, list[list[int]]], LLM]) -> None:
    expected, llm = llama_engines
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected["greedy"]
    # Per-rank memory was measured and reported; every rank got the same KV blocks.
    reports = llm.engine.executor.reports
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["memory"]["host_peak_bytes"] > 0 for r in reports)


def test_seeded_sampling_matches_tp1(llama_engines: tuple[dict[str, list[list[int]]], LLM]) -> None:
    expected, llm = llama_engines
    assert _tokens(llm.generate(PROMPTS, SEEDED)) == expected["seeded"]


def test_ranks_run_a_decode_step_while_the_engine_processes_the_last(
        llama_engines: tuple[dict[str, list[list[int]]], LLM]) -> None:
    """Async scheduling with tensor parallelism: decode step N+1 goes to the ranks before the
    engine processes step N's tokens (`_collect`), and N+1's logits are read only after that,
    so the ranks compute while the engine works. The calls are recorded on the real engine."""
    expected, llm = llama_engines
    engine, executor = llm.engine, llm.engine.executor
    events: list[tuple[str, int]] = []
    submit, collect = executor.submit, engine._collect

    def recording_submit(inputs, input_ids=None):
        n = sum(1 for kind, _ in events if kind == "submit")
        events.append(("submit", n))
        pending = submit(inputs, input_ids)
        read = pending._read

        def recording_read():
            events.append(("read", n))
            return read()

        pending._read = recording_read
        return pending

    def recording_collect(step):
        events.append(("collect", -1))
        return collect(step)

    executor.submit, engine._collect = recording_submit, recording_collect
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected["greedy"]
        stats = executor.step_stats()  # a step may still be in flight: its logits are read first
    finally:
        del executor.submit, engine._collect
    assert stats["rank0"]["steps"] > 0
    overlapped = [n for kind, n in events if kind == "submit"
                  if ("collect", -1) in events[events.index(("submit", n)):events.index(("read", n))]]
    # 6 tokens a prompt: the prefill step draws the first, then five decode steps, of which
    # every one after the first is sent before its predecessor's tokens are processed.
    assert len(overlapped) >= 4, events
    # ... and still gives the same tokens afterwards (the in-flight step was read in order).
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected["greedy"]


def test_unseeded_sampling_with_an_engine_seed_matches_tp1(
        llama_engines: tuple[dict[str, list[list[int]]], LLM]) -> None:
    """`seed=` makes unseeded draws repeatable; TP=2 draws them in TP=1's order (its deferred
    draws included), so the tokens are TP=1's. (Drawn first thing on both fresh engines, in
    the fixture.)"""
    expected, _ = llama_engines
    assert expected["unseeded_tp2"] == expected["unseeded"]


def test_killed_worker_fails_the_engine_naming_the_rank(
        llama_engines: tuple[dict[str, list[list[int]]], LLM]) -> None:
    _, llm = llama_engines
    pids = llm.engine.executor.worker_pids
    assert all(_alive(p) for p in pids)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1 died .*killed by signal 9"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - t0 < 30  # failed, not hung
    with pytest.raises(WorkerFailedError, match="rank 1"):  # and stays failed
        llm.generate(PROMPTS, GREEDY)
    assert _all_exit(pids, within_s=10)


def _executor_with(processes: list[subprocess.Popen[bytes]]) -> tuple[MultiprocExecutor, Any]:
    """An executor over `processes` (stand-ins for workers) whose rank 0 talks through a pipe."""
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._failure, executor.processes = None, processes
    engine_end, worker_end = multiprocessing.Pipe()
    executor.conns = [engine_end, None]
    return executor, worker_end


@pytest.mark.parametrize("peer", ["killed", "exited"])
def test_a_partners_report_names_the_killed_peer_seen_after_it(peer: str) -> None:
    """The race CI hit once: rank 1 is SIGKILLed, rank 0's collective breaks, and rank 0's error
    report can arrive before rank 1's exit shows. The failure names rank 1, the cause. A peer
    that exited by itself (a worker that raised reports, then exits 1) is not blamed."""
    rank0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)" if peer == "killed"
                              else "import time, sys; time.sleep(0.3); sys.exit(1)"])
    executor, rank0_end = _executor_with([rank0, rank1])
    try:
        rank0_end.send(("error", "Traceback ...\nRuntimeError: Read error: Connection reset by peer\n"))
        if peer == "killed":  # after the report is sent: its exit shows only while the engine reads it
            threading.Timer(0.3, rank1.kill).start()
        with pytest.raises(WorkerFailedError) as failed:
            executor._check_message(0, executor.conns[0], "logits")
        if peer == "killed":
            assert failed.value.rank == 1
            assert re.match(r"tensor-parallel worker rank 1 died .*killed by signal 9.*; rank 0 then failed "
                            r"with: RuntimeError: Read error: Connection reset by peer$", str(failed.value))
        else:
            assert failed.value.rank == 0 and "rank 0 failed:\nTraceback" in str(failed.value)
    finally:
        for process in (rank0, rank1):
            process.kill()
            process.wait()


def test_workers_exit_with_a_killed_engine(tmp_path: Path) -> None:
    """SIGKILL runs no clean-up in the engine: the workers notice on their own."""
    model = str(_save("llama", tmp_path / "llama"))
    script = (f"from kiln.runtime.llm import LLM\n"
              f"llm = LLM({model!r}, tensor_parallel_size=2, progress=False, max_model_len=128, max_num_seqs=8)\n"
              f"print(*llm.engine.executor.worker_pids, flush=True)\n"
              f"import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert _all_exit(pids, within_s=15)


def test_compile_tp2_fills_every_rank_and_explain_names_tp(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kiln.runtime.cli import main

    model = str(_save("llama", tmp_path / "llama"))
    cache = str(tmp_path / "cache")
    common = ["--cache-dir", cache, "--max-model-len", "128", "--max-num-seqs", "8"]
    out = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", "compile", model, "-tp", "2", "--compile", "graph",
                          *common], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2" in out.stderr and "rank 1 of 2" in out.stderr
    # `kiln cache explain` in this process (it reads keys, starts no engine): a subprocess
    # apiece only imported torch and Kiln again.
    assert main(["cache", "explain", model, "-tp", "2", "--compile", "graph", *common]) == 0
    explain = capsys.readouterr().out
    assert explain.count("2 of 2 entries would hit") == 2, explain
    # TP=1 against the TP=2 entries: the miss names tensor parallelism.
    main(["cache", "explain", model, "--compile", "graph", *common])
    explain1 = capsys.readouterr().out
    assert "tensor_parallel.size (2 there, 1 here)" in explain1, explain1
    # An engine started from that cache captures nothing on either rank.
    llm = LLM(model, tensor_parallel_size=2, compile="graph", cache_dir=cache, require_cache=True, **OPTIONS)
    try:
        assert not any(r["startup_report"].captured for r in llm.engine.executor.reports)
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY)) == _tokens(LLM(model, **OPTIONS).generate(PROMPTS[:1],
                                                                                                      GREEDY))
    finally:
        llm.engine.shutdown()


def test_serve_tp2_openai_client_and_killed_worker(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = str(text_model_dir(tmp_path_factory))
    prompt = "The quick brown fox"
    expected = LLM(model, **OPTIONS).generate(prompt, GREEDY)[0].outputs[0].text
    server = start_server(model, "-tp", "2", "--max-model-len", "128", "--max-num-seqs", "8")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        done = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert done.choices[0].text == expected
        pids = [int(p) for p in subprocess.run(["pgrep", "-f", "kiln.runtime.tp_worker", "-P", str(server.proc.pid)],
                                                capture_output=True, text=True).stdout.split()]
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert failed.value.status_code == 503 and "rank" in str(failed.value)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        with pytest.raises(openai.APIStatusError) as again:
            client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert again.value.status_code == 503
    finally:
        server.stop()
    assert _all_exit(pids, within_s=15)
