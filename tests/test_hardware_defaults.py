"""Engine limits from the hardware (kiln.runtime.hardware_defaults), tested without a GPU: the
choice takes the device's memory as an argument. Explicit settings always win; the decode
buckets stay bounded when max_num_seqs is large; max_model_len is the model's context when
one sequence of it fits in the KV cache."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.compiler.buckets import MAX_DEFAULT_DECODE_BUCKET, make_bucket_plan
from kiln.runtime.config import EngineConfig
from kiln.runtime.hardware_defaults import (
    GIB, choose_batch_limits, choose_max_model_len, default_batch_limits, model_context_length,
)

H200 = 141 * GIB
A10 = 24 * GIB


@pytest.mark.parametrize("device,memory,expected", [
    ("cuda", H200, (1024, 16384)),
    ("cuda", 80 * GIB, (1024, 16384)),
    ("cuda", 70 * GIB, (1024, 16384)),
    ("cuda", 48 * GIB, (256, 8192)),
    ("cuda", A10, (256, 8192)),
    ("cpu", None, (64, 2048)),
])
def test_defaults_follow_the_device(device, memory, expected):
    seqs, tokens, why = default_batch_limits(device, memory)
    assert (seqs, tokens) == expected
    assert ("GiB" in why) == (device == "cuda")


def test_explicit_settings_win():
    both = choose_batch_limits(8, 512, "cuda", H200)
    assert (both.max_num_seqs, both.max_num_batched_tokens, both.reason) == (8, 512, "set explicitly")
    one = choose_batch_limits(None, 4096, "cuda", H200)
    assert (one.max_num_seqs, one.max_num_batched_tokens) == (1024, 4096)
    assert one.reason.startswith("max_num_seqs from the device")
    other = choose_batch_limits(32, None, "cuda", A10)
    assert (other.max_num_seqs, other.max_num_batched_tokens) == (32, 8192)


def test_cuda_defaults_need_the_memory():
    with pytest.raises(ValueError, match="memory"):
        default_batch_limits("cuda", None)


def test_engine_config_resolves_unset_limits_only():
    cpu = torch.device("cpu")
    config, limits = EngineConfig(max_num_seqs=3).with_batch_limits(cpu)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (3, 2048)
    assert EngineConfig(max_num_batched_tokens=100).compile_options(device=cpu).max_num_batched_tokens == 100
    assert EngineConfig().compile_options(device=cpu).max_num_seqs == 64
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_decode_buckets_stay_bounded_at_large_gpu_defaults():
    plan = make_bucket_plan(1024, 16384)
    decode = [b.num_seqs for b in plan.decode]
    assert len(decode) <= 28 and max(decode) == MAX_DEFAULT_DECODE_BUCKET == 1024
    assert decode[-5:] == [512, 640, 768, 896, 1024]  # every 128 beyond 512
    assert len(plan.tokens) == 11  # 16 .. 16384
    # The offline workload's ~1,000-sequence decodes replay a CUDA graph (bench/RESULTS.md, J2).
    assert plan.bucket_for(1000, 1000).name == "decode-1024"
    # A decode of more sequences than the largest decode bucket runs in a token bucket.
    big = make_bucket_plan(2048, 16384)
    assert max(b.num_seqs for b in big.decode) == 1024 and big.bucket_for(1500, 1500).name == "tokens-2048"
    # Smaller limits keep the plan they always had.
    assert [b.num_seqs for b in make_bucket_plan(64, 2048).decode] == [1, 2, 4, 8, 16, 32, 48, 64]


def test_max_model_len_is_the_model_context_when_it_fits():
    assert choose_max_model_len(None, 131072, 2_000_000, 16) == (131072, "the model's context length")
    length, why = choose_max_model_len(None, 131072, 50_010, 16)
    assert length == 50_000 and "does not fit" in why  # whole blocks
    assert choose_max_model_len(1000, 131072, 50_000, 16) == (1000, "set explicitly")
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        choose_max_model_len(60_000, 131072, 50_000, 16)
    assert choose_max_model_len(None, None, 50_000, 16)[0] == 4096


def test_model_context_length_reads_the_config_names():
    from transformers import AutoConfig

    assert model_context_length(AutoConfig.for_model("llama", max_position_embeddings=32768)) == 32768
    assert model_context_length(AutoConfig.for_model("gpt2", n_positions=1024)) == 1024
    assert model_context_length(AutoConfig.for_model("mpt", max_seq_len=4096)) == 4096


def test_engine_logs_the_limits_it_chose(tiny_model_dir, caplog):
    from kiln.runtime import LLM

    path, _ = tiny_model_dir("llama")
    with caplog.at_level(logging.INFO, logger="kiln.runtime"):
        llm = LLM(str(path), dtype="float32", device="cpu", progress=False, num_kv_blocks=64)
    engine = llm.engine
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (64, 2048)
    assert engine.scheduler.max_num_seqs == 64
    # The tiny config's context (512) fits in 63 blocks of 16: the model's own length, uncapped.
    assert engine.max_model_len == 512
    text = caplog.text
    assert "max_num_seqs=64, max_num_batched_tokens=2048 (max_num_seqs and max_num_batched_tokens from the " \
           "device: cpu defaults)" in text
    assert "max_model_len=512 (the model's context length)" in text
    # A cache too small for one sequence of the model's context: lowered, and said why.
    small = LLM(str(path), dtype="float32", device="cpu", progress=False, num_kv_blocks=9, max_num_seqs=2)
    assert small.engine.max_model_len == 128


