"""The CUDA engine: decode steps replay captured CUDA graphs and give the eager tokens;
the KV cache is sized from profiled memory."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 7, 9, 11, 13, 2], [3, 4], list(range(10, 47))]


def test_cuda_graph_decode_matches_eager_and_hf(tiny_model_dir) -> None:
    path, hf = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = LLM(str(path), device="cuda", dtype="float32", enforce_eager=True, progress=False)
    graphed = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8, progress=False)
    eager_out = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    graph_out = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS, params)]
    assert graph_out == eager_out
    replays = {k: v for k, v in graphed.engine.runner.bucket_counts.items() if k.startswith("cudagraph-decode")}
    assert sum(replays.values()) >= 20, replays  # decode steps went through the graphs
    hf = hf.to("cuda")
    for prompt, toks in zip(PROMPTS, graph_out):
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert toks == ref[0, len(prompt):].tolist()


def test_mixed_step_graphs_match_eager(tiny_model_dir) -> None:
    """Mixed steps (prefill chunks beside decodes) replayed from their CUDA graphs, padded to
    a mixed bucket, give the eager engine's tokens, with async scheduling's continuations
    (their input ids scattered on the device) among them; prompt logprobs, whose rows no
    graph has, still run eagerly."""
    path, _ = tiny_model_dir("llama")
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, progress=False)
    eager = LLM(str(path), enforce_eager=True, **common)
    graphed = LLM(str(path), cuda_graph_mixed_tokens=64, **common)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    # Arriving one after another, so most steps bring a new prompt's chunks to running decodes.
    engine = graphed.engine
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        step()
    while engine.has_unfinished():
        step()
    assert [outs[str(i)] for i in range(len(prompts))] == want
    counts = engine.runner.bucket_counts
    mixed = {k: v for k, v in counts.items() if k.startswith("cudagraph-mixed")}
    assert sum(mixed.values()) >= 3, counts
    assert not any(k.startswith("tokens-") for k in counts)  # graph mode runs no artifacts
    logprob_params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    got = graphed.generate([prompts[0]], logprob_params)[0]
    ref = eager.generate([prompts[0]], logprob_params)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(got.prompt_logprobs) == len(ref.prompt_logprobs)


def test_kv_cache_is_sized_from_profiled_memory(tiny_model_dir) -> None:
    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=4,
              gpu_memory_utilization=0.05, progress=False)
    engine = llm.engine
    assert engine.activation_peak_bytes > 0
    _, total = torch.cuda.mem_get_info()
    kv_bytes = engine.num_kv_blocks * engine.config.block_size * engine.kv_bytes_per_token()
    assert kv_bytes <= 0.05 * total
    with pytest.raises(ValueError, match="max_model_len|never fit"):
        engine.add_request("too-long", [5] * 600, SamplingParams(max_tokens=8))


def test_async_scheduling_is_invisible_on_cuda(tiny_model_dir) -> None:
    """On CUDA, where a continuation's uploads are queued behind the step in flight and its
    in-flight tokens are scattered into its input ids on the device: async scheduling (decode
    and mixed continuations, graph replays) gives the synchronous engine's outputs."""
    from test_runtime_async_scheduling import make_engine, mixed_requests, record_continuations, run

    path, _ = tiny_model_dir("llama")
    cuda = dict(device="cuda", dtype="float32")
    probe = run(make_engine(str(path), False, **cuda), mixed_requests({}))
    stops = {"stop": probe["stop"][0][0][4], "min_tokens": probe["min_tokens"][0][0][2]}
    want = run(make_engine(str(path), False, **cuda), mixed_requests(stops))
    engine = make_engine(str(path), True, **cuda)
    carried_chunks = record_continuations(engine)
    assert run(engine, mixed_requests(stops)) == want
    assert any(carried_chunks) and not all(carried_chunks)
