#!/usr/bin/env bash
# Every GPU check of the CUDA path (issue 5) in one script, run on the lent GPU machine.
#
#   bash bench/gpu_smoke.sh [STAGE...]       STAGE: tests latency throughput startup (default: all)
#
# Each stage writes under $OUT (default ./gpu-out): tests -> pytest-gpu.txt + junit-gpu.xml,
# latency.json, throughput.json, startup.json, and each stage's log. A device command may
# run 10 minutes at most: run `tests latency` in one call and `throughput startup` in the
# next. SMOKE_FULL=1 runs the full workloads of the issue (1,000 throughput requests and
# 128 decode steps) instead of the smaller ones that fit a call; the JSON says which ran.
#
# On a bare device machine (see ../shared/device/README.md) the wheels in .whl/ and an
# editable install of kiln are set up first when kiln is not importable yet.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=${*:-tests latency throughput startup}
FULL=${SMOKE_FULL:-0}
# One Kiln cache for the latency and throughput stages (the second starts warm where plans
# overlap); outside $OUT so artifacts are not shipped back. startup.py uses its own.
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
# Small bucket plans: a cold compile of every default bucket of an 8B model would not fit
# a 10-minute call. Decode steps pad up to the next decode bucket.
LATENCY_BUCKETS="--decode-buckets 1,8,32,128 --token-buckets 128,2048"
THROUGHPUT_BUCKETS="--decode-buckets 16,64,128,192,256 --token-buckets 512,2048,8192"

if ! $PY -c "import kiln.kernels" 2>/dev/null; then
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
$PY - <<'EOF' | tee "$OUT/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
EOF

status=0
run_stage() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local start=$(date +%s)
  timeout --signal=INT "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc in $(( $(date +%s) - start ))s"
  tail -25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

for stage in $STAGES; do
  case $stage in
    tests)
      # The Triton kernels at real shapes, CUDA-graph capture, GPU-vs-CPU parity, and the
      # small interpreter tests compiled for the GPU this time.
      run_stage tests 540 $PY -m pytest -q -p no:cacheprovider -rfEs --junitxml="$OUT/junit-gpu.xml" \
        tests/test_gpu_kernels.py tests/test_gpu_cuda_graphs.py tests/test_gpu_fusion_parity.py \
        tests/test_kernels_triton.py tests/test_kernels_ops.py
      cp "$OUT/tests.log" "$OUT/pytest-gpu.txt"
      ;;
    latency)
      if [ "$FULL" = 1 ]; then steps=128; hf_steps=32; else steps=64; hf_steps=16; fi
      run_stage latency 560 $PY bench/latency.py --steps $steps --hf-steps $hf_steps $LATENCY_BUCKETS \
        --out "$OUT/latency.json"
      ;;
    throughput)
      if [ "$FULL" = 1 ]; then n=1000; hf=128; else n=256; hf=64; fi
      run_stage throughput 560 $PY bench/throughput.py --num-requests $n --hf-requests $hf $THROUGHPUT_BUCKETS \
        --out "$OUT/throughput.json"
      ;;
    startup)
      run_stage startup 560 $PY bench/startup.py $LATENCY_BUCKETS --out "$OUT/startup.json"
      ;;
    *)
      echo "unknown stage $stage (tests latency throughput startup)"; status=2
      ;;
  esac
done
exit $status
