"""Tiny random models of every supported architecture, built from config objects.

Nothing is downloaded: each config is small enough to build and run in well under a
second on CPU, yet keeps the features that matter (GQA, tied embeddings, q/k norm, MoE,
sliding window, Llama 3.1 rope scaling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)


def tiny_config(arch: str) -> Any:
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
    if arch == "llama2":  # MHA, tied embeddings
        return tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True)
    if arch == "llama3.1":
        return tf.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=24)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32)
    if arch == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(arch)


ARCHS = ("llama", "llama2", "llama3.1", "mistral", "qwen2", "qwen3", "mixtral")


def save_tiny_model(arch: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Build the HF model with random weights, save it (safetensors + config) and return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # Larger-than-default init spreads the logits so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model
