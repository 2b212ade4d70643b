"""`AsyncLLMEngine` on a tiny random model: batching across callers, aborts, the waiting
bound, and a failing engine step that takes down only the requests it was running."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kiln.runtime.serving.async_engine import AsyncLLMEngine, EngineStepError, EngineStoppedError, QueueFullError
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    path, _ = tiny_model_dir("llama")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=128, max_num_seqs=2,
                                  num_kv_blocks=64, progress=False))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_batch_and_finish(engine: LLMEngine) -> None:
    async def main() -> tuple[list, int]:
        ae = AsyncLLMEngine(engine)
        await ae.start()
        steps_before = engine.stats().num_steps
        streams = [await ae.add_request(f"b{i}", [1 + i, 5, 9], greedy(10)) for i in range(2)]
        outs = await asyncio.gather(*(s.result() for s in streams))
        steps = engine.stats().num_steps - steps_before
        await ae.shutdown()
        return outs, steps

    outs, steps = run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert steps < 20  # two requests of 10 tokens shared their steps


def test_stream_yields_growing_outputs(engine: LLMEngine, monkeypatch) -> None:
    # A stream keeps only the latest output, so a reader slower than the engine sees fewer:
    # on a loaded 2-core CI machine the tiny model's six steps could all finish before the
    # event loop woke the reader, which then saw [6] alone. Each step after the first here
    # waits (up to 5 s) for the reader to have taken an output, as a reader keeping up would.
    read = threading.Event()
    step = engine.step
    first = True

    def paced_step():
        nonlocal first
        if not first:
            read.wait(timeout=5.0)
            read.clear()
        first = False
        return step()

    monkeypatch.setattr(engine, "step", paced_step)

    async def main() -> list[int]:
        ae = AsyncLLMEngine(engine)
        await ae.start()
        stream = await ae.add_request("s", [3, 4, 5], greedy(6))
        seen = []
        async for out in stream:
            seen.append(len(out.outputs[0].token_ids))
            read.set()
        await ae.shutdown()
        return seen

    seen = run(main())
    assert seen == [1, 2, 3, 4, 5, 6], seen  # one output a step, none skipped, ending finished


def test_refused_request_reports_to_its_caller_only(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = AsyncLLMEngine(engine)
        await ae.start()
        ok = await ae.add_request("ok", [1, 2, 3], greedy(4))
        with pytest.raises(ValueError, match="max_tokens"):
            await ae.add_request("too-long", [1, 2, 3], greedy(500))
        with pytest.raises(ValueError, match="vocabulary"):
            await ae.add_request("bad-ids", [10**6], greedy(2))
        out = await ok.result()
        assert len(out.outputs[0].token_ids) == 4
        assert ae.num_waiting_requests == 0
        await ae.shutdown()

    run(main())


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = AsyncLLMEngine(engine)
        await ae.start()
        stream = await ae.add_request("long", list(range(1, 40)), greedy(80))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        assert engine.stats().num_used_blocks > 0
        ae.abort("long")
        for _ in range(100):
            if engine.stats().num_used_blocks == 0 and not engine.has_unfinished():
                break
            await asyncio.sleep(0.05)
        assert engine.stats().num_used_blocks == 0
        assert not engine.has_unfinished()
        await ae.shutdown()

    run(main())


def test_waiting_queue_bound(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = AsyncLLMEngine(engine, max_waiting_requests=2)
        await ae.start()
        streams = [await ae.add_request(f"q{i}", [1, 2], greedy(3)) for i in range(2)]
        if ae.num_waiting_requests == 2:  # neither has produced a token yet
            with pytest.raises(QueueFullError):
                ae.check_capacity(1)
        for s in streams:
            await s.result()
        ae.check_capacity(2)  # room again once they started
        await ae.shutdown()

    run(main())


def test_failing_step_fails_only_the_requests_it_ran(engine: LLMEngine) -> None:
    """max_num_seqs=2: 'a' and 'b' run, 'c' waits. One step raises: 'a' and 'b' get an error,
    'c' and later requests complete, and no KV block leaks."""
    real_execute = engine.runner.execute
    fault = {"armed": False, "fired": 0}

    def flaky_execute(*args, **kwargs):
        if fault["armed"]:
            fault["armed"] = False
            fault["fired"] += 1
            raise RuntimeError("injected kernel failure")
        return real_execute(*args, **kwargs)

    async def main() -> None:
        ae = AsyncLLMEngine(engine)
        await ae.start()
        a = await ae.add_request("a", [1, 2, 3], greedy(60))
        b = await ae.add_request("b", [4, 5, 6], greedy(60))
        async for out in a:
            if len(out.outputs[0].token_ids) >= 2:
                break
        c = await ae.add_request("c", [7, 8, 9], greedy(5))  # waits: both slots are taken
        fault["armed"] = True
        for stream in (a, b):
            with pytest.raises(EngineStepError, match="injected kernel failure"):
                await stream.result()
        out_c = await c.result()
        assert len(out_c.outputs[0].token_ids) == 5
        d = await ae.add_request("d", [1, 1, 1], greedy(3))
        assert len((await d.result()).outputs[0].token_ids) == 3
        assert ae.is_healthy
        assert ae.stats.num_step_failures == 1
        assert engine.stats().num_used_blocks == 0 and not engine.has_unfinished()
        engine.check_invariants()
        await ae.shutdown()

    engine.runner.execute = flaky_execute
    try:
        run(main())
    finally:
        engine.runner.execute = real_execute
    assert fault["fired"] == 1


def test_shutdown_fails_open_streams_and_refuses_new_requests(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = AsyncLLMEngine(engine)
        await ae.start()
        stream = await ae.add_request("open", [1, 2, 3], greedy(100))
        await ae.shutdown()
        with pytest.raises(EngineStoppedError):
            await stream.result()
        with pytest.raises(EngineStoppedError):
            await ae.add_request("late", [1, 2], greedy(2))
        assert not ae.is_healthy
        assert not engine.has_unfinished() and engine.stats().num_used_blocks == 0

    run(main())
