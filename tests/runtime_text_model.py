"""A tiny random Llama that speaks through a real tokenizer (SmolLM2's, with its chat template).

Text-level runtime tests (detokenizer, stop strings, chat template, the CLI) need real
tokens and real UTF-8 fragments but not a real model: this is the tiny Llama of
tests/tiny_models.py with the vocabulary of the default model. Its weights are random, so
its text is gibberish full of multi-byte fragments, which is what those tests want.

Built once per pytest session (under the session's base temp dir), since reading the
tokenizer out of the GGUF file takes several seconds (`load_default_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_default_tokenizer() -> Any:
    """The default model's tokenizer, read out of its GGUF file (~11 s) or, when Kiln has
    already converted that file into its cache (a default-model run on this machine did),
    from the converted directory (<1 s): the conversion saved `AutoTokenizer`'s tokenizer of
    the same GGUF file with `save_pretrained`, so either gives the same tokenizer files."""
    from transformers import AutoTokenizer

    from kiln.compiler.model_source import default_model_path, gguf_conversion_dir

    gguf = default_model_path()
    converted = gguf_conversion_dir(gguf)
    if (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(converted))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build_text_model(path: Path, seed: int = 0) -> Path:
    """Save tokenizer + tiny Llama (vocabulary of the default model) into `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import COMMON

    if (path / "config.json").is_file():
        return path
    tokenizer = load_default_tokenizer()
    tokenizer.save_pretrained(path)
    # The tokenizer's special ids replace COMMON's (which also sets them, for models without one).
    config = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def text_model_dir(tmp_path_factory: Any) -> Path:
    return build_text_model(tmp_path_factory.getbasetemp() / "kiln-tiny-text-model")
