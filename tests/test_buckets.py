"""Bucket plan and padding: which bucket a step runs in, and that padding changes nothing real."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.buckets import (
    DECODE, TOKENS, BucketPlanError, decode_bucket, default_decode_sizes, default_token_sizes, make_bucket_plan,
    mixed_bucket, mixed_graph_sizes, parse_bucket_spec, token_bucket,
)


def test_default_plan_sizes():
    assert default_decode_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_decode_sizes(6) == [1, 2, 4, 6]
    assert default_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_token_sizes(100) == [16, 32, 64, 100]
    assert default_token_sizes(8) == [8]
    plan = make_bucket_plan(64, 2048)
    assert [b.name for b in plan.decode] == ["decode-1", "decode-2", "decode-4", "decode-8", "decode-16",
                                             "decode-32", "decode-48", "decode-64"]
    # A token bucket has one sequence row fewer than tokens, and never more than max_num_seqs.
    assert plan.tokens[0].num_seqs == 15 and plan.tokens[-1].num_seqs == 64
    # Decode buckets are capped by the token budget too (a decode of N sequences is N tokens).
    assert max(b.num_seqs for b in make_bucket_plan(64, 8).decode) == 8


def test_token_and_mixed_buckets_have_fewer_sequences_than_tokens():
    """A step that is no decode has a chunk of two or more tokens, so fewer sequences than
    tokens: its bucket (a compiled artifact's `tokens-N`, a CUDA graph's `mixed-N`) has N - 1
    sequence rows (capped by max_num_seqs), so its padded attention never takes the decode
    kernel's one-token-at-a-time path (the launcher sends `tokens <= sequences` there), and a
    decode-shaped step never fits a mixed bucket."""
    for bucket in (token_bucket(16, 64), token_bucket(1024, 1024), mixed_bucket(256, 1024)):
        assert bucket.num_tokens > bucket.num_seqs == bucket.num_samples == bucket.num_tokens - 1
    assert token_bucket(2048, 1024).num_seqs == 1024 and token_bucket(1, 64).num_seqs == 1
    assert mixed_graph_sizes(2048) == [64, 128, 256, 512, 1024, 2048]
    assert mixed_graph_sizes(300) == [64, 128, 256, 300]
    assert mixed_graph_sizes(64) == [64] and mixed_graph_sizes(63) == [] and mixed_graph_sizes(0) == []
    b = mixed_bucket(256, 1024)
    assert (b.name, b.num_tokens, b.num_seqs, b.num_samples) == ("mixed-256", 256, 255, 255)
    assert mixed_bucket(2048, 1024).num_seqs == 1024
    assert b.fits(256, 255) and b.fits(100, 3) and not b.fits(100, 100) and not b.fits(257, 3)


def test_the_engine_asks_for_mixed_graphs_within_its_step_budget():
    """`cuda_graph_mixed_tokens` (512 by default) is capped by the step budget, 0 asks for
    none, and a model with recurrent layers gets none (its mixed steps read chunk lengths on
    the host)."""
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.kv_cache import mixed_graph_token_sizes

    plan = make_bucket_plan(64, 256)
    assert mixed_graph_token_sizes(EngineConfig(cuda_graph_mixed_tokens=300), plan, False) == [64, 128, 256]
    assert mixed_graph_token_sizes(EngineConfig(cuda_graph_mixed_tokens=128), plan, False) == [64, 128]
    assert mixed_graph_token_sizes(EngineConfig(cuda_graph_mixed_tokens=128), plan, True) == []
    assert mixed_graph_token_sizes(EngineConfig(cuda_graph_mixed_tokens=0), plan, False) == []
    # By default up to 512 tokens (bench/RESULTS.md, AQ1 and AR1-AR2), within the budget.
    assert mixed_graph_token_sizes(EngineConfig(), plan, False) == [64, 128, 256]
    assert mixed_graph_token_sizes(EngineConfig(), make_bucket_plan(256, 16384), False) == [64, 128, 256, 512]
    with pytest.raises(ValueError, match="cuda_graph_mixed_tokens"):
        EngineConfig(cuda_graph_mixed_tokens=-1)


def test_the_runner_picks_the_smallest_captured_graph():
    """Which captured graph a step replays (ModelRunner._graph_bucket; the capture itself
    needs CUDA, tests/test_gpu_engine.py): decodes the smallest decode graph that holds them,
    mixed steps the smallest mixed graph holding their tokens, sequences and sampled rows,
    and anything larger (or decode-shaped with extra rows: prompt logprobs) none."""
    from kiln.runtime.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # the selection reads these two tables alone
    runner._decode_graph_sizes = [1, 2, 4, 8]
    runner._mixed_graph_buckets = [mixed_bucket(n, 8) for n in (64, 128)]
    assert runner._graph_bucket(3, 3, 3) == decode_bucket(4)
    assert runner._graph_bucket(9, 9, 9) is None
    assert runner._graph_bucket(3, 3, 5) is None
    assert runner._graph_bucket(40, 5, 5).name == "mixed-64"
    assert runner._graph_bucket(65, 2, 2).name == "mixed-128"
    assert runner._graph_bucket(100, 9, 9) is None  # more sequences than max_num_seqs allows a graph
    assert runner._graph_bucket(100, 2, 20) is None  # prompt logprobs' rows
    assert runner._graph_bucket(129, 2, 2) is None


def test_bucket_for_picks_smallest_fitting():
    plan = make_bucket_plan(64, 2048)
    assert plan.bucket_for(1, 1) == decode_bucket(1)
    assert plan.bucket_for(3, 3) == decode_bucket(4)
    assert plan.bucket_for(33, 33) == decode_bucket(48)
    # Not a pure decode (more tokens than sequences): a token bucket.
    assert plan.bucket_for(5, 2) == token_bucket(16, 64)
    assert plan.bucket_for(17, 1) == token_bucket(32, 64)
    assert plan.bucket_for(2048, 64) == token_bucket(2048, 64)
    with pytest.raises(BucketPlanError, match="no bucket holds a step of 2049 tokens"):
        plan.bucket_for(2049, 3)
    with pytest.raises(ValueError, match="not a valid step"):
        plan.bucket_for(2, 3)


def test_decode_larger_than_every_decode_bucket_uses_a_token_bucket():
    plan = make_bucket_plan(8, 64, decode_sizes=[1, 2])
    b = plan.bucket_for(5, 5)
    assert b.kind == TOKENS and b.num_tokens == 16 and b.num_seqs == 8


def test_a_decode_filling_the_token_budget_fits_the_largest_token_bucket():
    # Decode buckets that stop short of max_num_seqs, and a token budget no larger than it: a
    # decode of the whole budget has no bucket but the largest token one, which therefore keeps
    # as many rows as tokens (the others have one fewer).
    plan = make_bucket_plan(64, 64, decode_sizes=[1, 2])
    assert [b.num_seqs for b in plan.tokens] == [15, 31, 64]
    assert plan.bucket_for(64, 64).name == "tokens-64" and plan.bucket_for(16, 16).name == "tokens-32"
    assert plan.bucket_for(20, 3).name == "tokens-32"


def test_explicit_sizes_are_checked():
    with pytest.raises(BucketPlanError, match="largest token bucket .32. is below max_num_batched_tokens=64"):
        make_bucket_plan(4, 64, token_sizes=[16, 32])
    with pytest.raises(BucketPlanError, match="exceed max_num_batched_tokens"):
        make_bucket_plan(4, 64, token_sizes=[64, 128])
    with pytest.raises(BucketPlanError, match="exceed max_num_seqs=4"):
        make_bucket_plan(4, 64, decode_sizes=[1, 8])
    with pytest.raises(BucketPlanError, match="positive integers"):
        make_bucket_plan(4, 64, decode_sizes=[0])


def test_parse_bucket_spec():
    assert parse_bucket_spec(["decode:4,1,2", "tokens:64"]) == ([1, 2, 4], [64])
    assert parse_bucket_spec(["tokens:32", "tokens:16"]) == (None, [16, 32])
    assert parse_bucket_spec([]) == (None, None)
    with pytest.raises(BucketPlanError, match="expected 'decode:N,N,...'"):
        parse_bucket_spec(["prefill:4"])
    with pytest.raises(BucketPlanError, match="must be integers"):
        parse_bucket_spec(["decode:1,x"])


def test_describe_lists_every_bucket():
    text = make_bucket_plan(2, 32).describe()
    for name in ("decode-1", "decode-2", "tokens-16", "tokens-32"):
        assert name in text


@pytest.fixture(scope="module")
def tiny_graph(tiny_model_dir):
    from kiln.compiler.model_source import resolve_model
    from kiln.compiler.pipeline import build_model_graph

    path, _ = tiny_model_dir("llama")
    source = resolve_model(str(path))
    graph = build_model_graph(source.config, torch.float32, "cpu", block_size=4)
    spec = graph.spec()
    from kiln.passes.weight_transforms import apply_weight_transforms

    weights = apply_weight_transforms(source.load_weights(spec.param_aliases, torch.float32, "cpu", progress=False),
                                      spec.weight_transforms)
    return source.config, graph, weights


def _runner(config, graph, weights, num_blocks, bucket_fns=None, plan=None):
    from kiln.runtime.kv_cache import allocate_kv_caches
    from kiln.runtime.model_runner import ModelRunner

    heads = config.num_key_value_heads
    caches = allocate_kv_caches(config.num_hidden_layers, num_blocks, 4, heads,
                                config.hidden_size // config.num_attention_heads, torch.float32, torch.device("cpu"))
    for c in caches:
        c.zero_()
    spec = graph.spec()
    return ModelRunner(None if bucket_fns else graph.graph_module, spec.input_roles, weights, spec.constants, caches,
                       torch.device("cpu"), bucket_fns=bucket_fns, plan=plan)


def _mixed_step():
    """One prefill of 5 tokens (blocks 1-2) and one decode at position 6 (blocks 3-4), block size 4."""
    from kiln.compiler.graph_inputs import StepInputs

    return StepInputs(
        input_ids=torch.tensor([[3, 9, 27, 81, 5, 17]]),
        position_ids=torch.tensor([[0, 1, 2, 3, 4, 6]]),
        slot_mapping=torch.tensor([4, 5, 6, 7, 8, 18]),
        block_tables=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        seq_lens=torch.tensor([5, 7], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32),
        logits_indices=torch.tensor([4, 5]),
    )


def test_padding_changes_no_real_row_and_writes_only_the_null_block(tiny_graph):
    """The eager graph on a step and on the same step padded to a bucket: same logits for the
    real rows, and the KV caches differ only in the null block 0 (where padding writes)."""
    from kiln.runtime.model_runner import pad_step_inputs

    config, graph, weights = tiny_graph
    step = _mixed_step()
    plain = _runner(config, graph, weights, num_blocks=6)
    padded_runner = _runner(config, graph, weights, num_blocks=6)
    # Decode position 6 reads positions 0-5 of its sequence: fill them identically in both caches.
    for a, b in zip(plain.kv_caches, padded_runner.kv_caches):
        a[:, 3:5].normal_(generator=torch.Generator().manual_seed(1))
        b.copy_(a)
    bucket = token_bucket(16, 8)
    padded = pad_step_inputs(step, bucket)
    assert padded.input_ids.shape == (1, 16) and padded.seq_lens.shape == (8,)
    assert padded.query_start_loc.tolist() == [0, 5, 6, 6, 6, 6, 6, 6, 6]
    assert padded.slot_mapping[6:].eq(0).all() and padded.logits_indices.shape == (8,)
    want = plain.execute(step)
    got = padded_runner.execute(padded)[: want.shape[0]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain.kv_caches, padded_runner.kv_caches):
        torch.testing.assert_close(a[:, 1:], b[:, 1:], rtol=1e-5, atol=1e-5)  # GEMM rounding only


def test_runner_pads_each_step_to_its_bucket(tiny_graph):
    """A runner with per-bucket functions (the eager graph standing in for artifacts) returns
    the unpadded runner's logits, and records which bucket each step used."""
    config, graph, weights = tiny_graph
    plan = make_bucket_plan(8, 16)
    gm = graph.graph_module
    fns = {b: (lambda args: gm(*args)) for b in plan.buckets()}
    bucketed = _runner(config, graph, weights, 6, bucket_fns=fns, plan=plan)
    plain = _runner(config, graph, weights, 6)
    for a, b in zip(plain.kv_caches, bucketed.kv_caches):
        a[:, 3:5].normal_(generator=torch.Generator().manual_seed(2))
        b.copy_(a)
    step = _mixed_step()
    torch.testing.assert_close(bucketed.execute(step), plain.execute(step), rtol=1e-5, atol=1e-5)
    assert bucketed.bucket_counts == {"tokens-16": 1}


def test_engine_with_bucketed_runner_matches_eager(tiny_model_dir):
    """Whole generations (chunked prefills, mixed steps, decodes of 1-3 sequences) through the
    padding path give the eager engine's tokens."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), compile="eager", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64,
              enable_prefix_caching=False, progress=False)
    prompts = [[5, 6, 7], list(range(1, 30)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    plan = make_bucket_plan(3, 16, decode_sizes=[1, 2, 3])
    gm = engine.graph.graph_module
    engine.runner = engine.runner.twin(bucket_fns={b: (lambda args: gm(*args)) for b in plan.buckets()}, plan=plan)
    bucketed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert bucketed == eager
    counts = engine.runner.bucket_counts
    assert counts.get("tokens-16", 0) >= 2 and any(k.startswith(DECODE) for k in counts)
