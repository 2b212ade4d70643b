"""Async scheduling (LLMEngine.step): the next step (decodes, prefill chunks, admissions) is
launched before the previous step's tokens are read back. It must be invisible in the outputs: the same tokens, finish
reasons and prefix-cache behaviour as an engine that reads every step back first, with
sequences ending by value (stop tokens), by length, by abort, and requests that cannot be
deferred (penalties, logprobs, min_tokens) mixed in. Tiny random Llama on CPU, float32.
"""

from __future__ import annotations

import random

import pytest

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.engine import LLMEngine

VOCAB = 128


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    return str(path)


def make_engine(model_dir: str, async_scheduling: bool, **kw) -> LLMEngine:
    opts = dict(block_size=16, max_num_seqs=6, max_num_batched_tokens=64, progress=False,
                async_scheduling=async_scheduling)
    opts.update(kw)
    return LLM(model_dir, **opts).engine


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
        abort_after: dict[str, int] | None = None) -> dict[str, list[tuple[list[int], str | None]]]:
    """Add every request, step to the end checking block invariants; returns the final
    outputs by request id. `abort_after[rid] = k` aborts rid after the k-th step."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final: dict[str, list[tuple[list[int], str | None]]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        steps += 1
        engine.check_invariants()
        for rid, k in (abort_after or {}).items():
            if k == steps:
                out = engine.abort(rid)
                if out is not None:
                    final[rid] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        assert steps < 2000
    assert engine.block_manager.num_used_blocks == 0
    return final


def record_continuations(engine: LLMEngine) -> list[bool]:
    """A list that gets, per continuation `engine` schedules, whether it carried prefill
    chunks (a mixed step) rather than decodes only."""
    carried_chunks: list[bool] = []
    schedule_continuation = engine.scheduler.schedule_continuation

    def recording(ending=()):
        items = schedule_continuation(ending)
        if items is not None:
            carried_chunks.append(any(item.num_new_tokens > 1 for item in items))
        return items

    engine.scheduler.schedule_continuation = recording
    return carried_chunks


def mixed_requests(stop_tokens: dict[str, int]) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    shared = prompt(40)  # two requests share 2 full blocks: the prefix cache is exercised
    return [
        ("greedy", prompt(20), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)),
        ("stop", prompt(33), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                            stop_token_ids=[stop_tokens["stop"]] if "stop" in stop_tokens else [])),
        ("seeded", prompt(17), SamplingParams(max_tokens=25, temperature=0.9, top_k=20, top_p=0.9, seed=3,
                                              ignore_eos=True)),
        ("n2", prompt(9), SamplingParams(max_tokens=12, temperature=0.7, seed=11, n=2, ignore_eos=True)),
        ("penalty", prompt(12), SamplingParams(max_tokens=15, temperature=0, repetition_penalty=1.3,
                                               ignore_eos=True)),
        ("logprobs", prompt(5), SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)),
        ("min_tokens", prompt(6), SamplingParams(max_tokens=14, temperature=0, min_tokens=6,
                                                 stop_token_ids=[stop_tokens["min_tokens"]] if "min_tokens" in stop_tokens
                                                 else [])),
        ("prefix-a", shared + prompt(3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        ("prefix-b", shared + prompt(5), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        ("short", prompt(50), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)),
    ]


def test_async_scheduling_is_invisible(model_dir):
    # Pick stop tokens that really occur mid-output, from a synchronous greedy run.
    probe = run(make_engine(model_dir, False), mixed_requests({}))
    stops = {"stop": probe["stop"][0][0][4], "min_tokens": probe["min_tokens"][0][0][2]}
    sync_engine = make_engine(model_dir, False)
    async_engine = make_engine(model_dir, True)
    carried_chunks = record_continuations(async_engine)
    want = run(sync_engine, mixed_requests(stops))
    got = run(async_engine, mixed_requests(stops))
    assert got == want
    assert any(carried_chunks) and not all(carried_chunks)  # mixed continuations and decode ones
    assert want["stop"][0][1] == "stop" and len(want["stop"][0][0]) < 30  # ended by value, mid-flight
    assert async_engine.scheduler.stats.num_continuation_steps > 5  # rows that cannot defer hold it back
    assert sync_engine.scheduler.stats.num_continuation_steps == 0
    # The shared prompt blocks were found in the prefix cache by the later request both ways.
    assert async_engine.block_manager.prefix_stats.hits == sync_engine.block_manager.prefix_stats.hits > 0


def test_sequences_ending_by_value_mid_flight(model_dir):
    """Only deferrable rows: each request stops on a token first seen deep in its output, so
    the step after it was already launched; its extra token is discarded."""
    rng = random.Random(3)
    prompts = {f"s{i}": [rng.randrange(1, VOCAB) for _ in range(5 + 7 * i)] for i in range(5)}
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    probe = run(make_engine(model_dir, False), [(rid, p, greedy) for rid, p in prompts.items()])
    stops = {}
    for rid, [(tokens, _)] in probe.items():
        fresh = [t for i, t in enumerate(tokens) if i >= 8 and t not in tokens[:i]]
        if fresh:
            stops[rid] = fresh[0]
    assert len(stops) >= 2
    requests = [(rid, p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                        stop_token_ids=[stops[rid]] if rid in stops else []))
                for rid, p in prompts.items()]
    want = run(make_engine(model_dir, False), requests)
    engine = make_engine(model_dir, True)
    assert run(engine, requests) == want
    assert sum(reason == "stop" for [(_, reason)] in want.values()) == len(stops)
    assert engine.num_discarded_tokens >= 1
    assert engine.scheduler.stats.num_continuation_steps > 20


def test_sequences_ending_by_length_do_not_hold_back_the_next_step(model_dir):
    """Requests of different max_tokens (as an offline run's): a sequence whose in-flight
    token is its last is left out of the next step instead of making the engine read that
    token back first, so every step after the first is a continuation, with the same outputs
    as a synchronous engine."""
    rng = random.Random(5)
    requests = [(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(4 + 3 * i)],
                 SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True)) for i in range(5)]
    want = run(make_engine(model_dir, False), requests)
    engine = make_engine(model_dir, True)
    assert run(engine, requests) == want
    assert all(reason == "length" for [(_, reason)] in want.values())
    stats = engine.scheduler.stats
    assert stats.num_continuation_steps == stats.num_steps - 1
    assert engine.num_discarded_tokens == 0


def test_abort_while_a_step_is_in_flight(model_dir):
    requests = [(f"r{i}", [i + 1] * (10 + i), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i in range(4)]
    want = run(make_engine(model_dir, False), requests)
    engine = make_engine(model_dir, True)
    got = run(engine, requests, abort_after={"r1": 5, "r3": 9})
    assert engine.scheduler.stats.num_continuation_steps > 0
    for rid in ("r0", "r2"):
        assert got[rid] == want[rid]
    for rid, steps in (("r1", 5), ("r3", 9)):
        tokens, reason = got[rid][0]
        assert reason == "abort" and 0 < len(tokens) < 40
        assert tokens == want[rid][0][0][: len(tokens)]  # a prefix of the uninterrupted output
    assert not engine.has_unfinished()


def test_generate_reports_only_finished_requests(model_dir):
    """LLM.generate queues with every_step=False: step() returns nothing until a request ends."""
    llm = LLM(model_dir, block_size=16, max_num_seqs=4, progress=False)
    engine = llm.engine
    engine.add_request("quiet", [3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       every_step=False)
    engine.add_request("chatty", [3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    seen: dict[str, list[int]] = {"quiet": [], "chatty": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(len(out.outputs[0].token_ids))
    assert seen["chatty"] == [1, 2, 3, 4, 5, 6]
    assert seen["quiet"] == [6]


def test_async_scheduling_is_invisible_with_tensor_parallelism(model_dir):
    """TP=2 (gloo, two worker processes) sends a continuation to the ranks and reads its
    logits a step later (LLMEngine.step): the same outputs as a synchronous TP=1 engine, with
    the mixed requests above (stops mid-flight, seeds, n=2, penalties, logprobs, min_tokens,
    the prefix cache) and aborts while a step is in flight."""
    probe = run(make_engine(model_dir, False), mixed_requests({}))
    stops = {"stop": probe["stop"][0][0][4], "min_tokens": probe["min_tokens"][0][0][2]}
    want = run(make_engine(model_dir, False), mixed_requests(stops))
    aborts = [(f"r{i}", [i + 1] * (10 + i), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
              for i in range(4)]
    want_aborts = run(make_engine(model_dir, False), aborts)
    engine = make_engine(model_dir, True, tensor_parallel_size=2)
    try:
        assert run(engine, mixed_requests(stops)) == want
        assert engine.scheduler.stats.num_continuation_steps > 5
        got = run(engine, aborts, abort_after={"r1": 5, "r3": 9})
        assert got["r0"] == want_aborts["r0"] and got["r2"] == want_aborts["r2"]
        for rid in ("r1", "r3"):
            tokens, reason = got[rid][0]
            assert reason == "abort" and tokens == want_aborts[rid][0][0][: len(tokens)]
    finally:
        engine.shutdown()
