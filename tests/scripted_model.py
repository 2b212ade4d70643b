"""A tiny Llama that, greedily decoded, writes given replies: tests of reply parsing through
the whole server (real tokenizer, chat template, engine and client) need a model that
really writes `<think>` tags or harmony messages, which random weights never do.

How: every layer's output projections (attention's o_proj, the MLP's down_proj) are zero, so
the last hidden state is the current token's embedding (normalized); the LM head's row of
token B is the direction of token A's embedding wherever a script has B right after A.
Greedy decoding then follows each script from the prompt's last token to the end-of-sequence
token. The next token depends on the current token alone, so no token may be followed by two
different tokens across the scripts (the builder says which one is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HIDDEN = 128  # random embeddings this wide are near-orthogonal: the scripted logit wins by ~8 sigma


def script_successors(tokenizer: Any, starts: list[int], replies: list[str], end_id: int) -> dict[int, int]:
    """token -> the token a script writes after it; ValueError where two scripts disagree."""
    nxt: dict[int, int] = {}
    for start, reply in zip(starts, replies):
        ids = [start] + tokenizer.encode(reply, add_special_tokens=False) + [end_id]
        for a, b in zip(ids, ids[1:]):
            if nxt.setdefault(a, b) != b:
                raise ValueError(f"token {tokenizer.decode([a])!r} is followed by both "
                                 f"{tokenizer.decode([nxt[a]])!r} and {tokenizer.decode([b])!r}: change a reply")
    return nxt


def build_scripted_model(path: Path, tokenizer: Any, starts: list[int], replies: list[str], seed: int = 0) -> Path:
    """Save `tokenizer` and a Llama into `path` that answers a prompt ending in token
    `starts[i]` with `replies[i]`, then its end-of-sequence token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    nxt = script_successors(tokenizer, starts, replies, tokenizer.eos_token_id)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        emb = torch.randn(len(tokenizer), HIDDEN)
        model.model.embed_tokens.weight.copy_(emb)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(len(tokenizer), HIDDEN)
        for a, b in nxt.items():
            head[b] += 4.0 * emb[a] / emb[a].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path
