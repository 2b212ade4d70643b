#!/usr/bin/env bash
# Every GPU check of the CUDA path (issue 5), as run for bench/RESULTS.md, on the lent GPU machine.
#
#   bash bench/gpu_smoke.sh [STAGE...]    STAGE: tests tests_a tests_b tests_c tests_d tests_e latency latency_graph latency_inductor
#                                         load_weights throughput startup profile
#                                         profile_throughput tune_attention tune_attention_fp8 tune_gemv tune_gemv_fp8 moe_tests
#                                         moe_mixtral_decode moe_mixtral_offline moe_qwen3
#                                         moe_profile_throughput tune_moe
#                                         arch_tests serve serve_fp8 serve_plot
#                                         fp8_tests fp8_gemm fp8_latency fp8_throughput fp8_profile fp8_fast_accum
#                                         fp8_profile_throughput overlap tp_tests tp1_before_after allreduce tp70b tp8b
#                                         pdl_ab l2_prefetch split_k_tests tune_gemv_split_k tune_gemv_wide tune_gemv_narrow
#                                         fused_combine_ab small_rows_16bit_ab tune_gemv_swap norm_early_weight_ab
#                                         fused_rope_ab one_writer_ab fused_rope_norms_ab pdl_trigger_tests
#                                         pdl_trigger_families_ab pdl_fp8_quant_ab moe_mixtral_budgets bf16_budgets
#                                         moe_tma_ab moe_parts moe_grouping_ab moe_fp8_experts
#                                         fp8_70b tp70b_fp8 gpt_oss_tests moe_gpt_oss_20b
#                                         moe_llama4_scout latent_kernel_ab tune_latent moe_qwen3_next olmo2_latency
#                                         mamba_latency w8a8_defaults moe_routers moe_deepseek_v2_lite profile_inductor
#                                         serve_mixed_graphs_ab profile_capture
#                                         gemv_tuned_ab (GEMV_TUNED=<a tune_gemv.py --fp8 result>)
#                                         (default: tests latency throughput startup)
#
# Each stage writes STAGE.log and STAGE.json (tests*: STAGE.log) under $OUT (default
# ./gpu-out). Stage times on the H200 (2026-11-30; 2026-12-04 for the tests): tests_a ~5.5 min,
# tests_b ~5 min (AB2-AB3, one process each; the whole suite, `tests`, in one process no longer fits one
# device command; on four processes, GPU_TEST_WORKERS below, it took 421 s on an H100 in AN2), latency ~2 min (Hugging Face baseline
# included), throughput ~1.5 min (the issue's 1,000 requests; baseline on 64), startup ~1 min,
# profile ~2 min, profile_throughput ~1.5 min, tune_attention ~2 min. A device command may
# run 10 minutes: split the stages over calls.
#
# On a bare device machine (see ../shared/device/README.md) the wheels in .whl/ and an
# editable install of kiln are set up first when kiln is not importable yet.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=${*:-tests latency throughput startup}
export PYTHONUNBUFFERED=1

# A warm machine keeps /tmp/site and the editable install from an earlier command, but not
# this variable: without it the wheels' packages (diskcache, ...) are missing there.
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import kiln.kernels" 2>/dev/null; then
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    [[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]] || export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
# The example out-of-tree pass: the `tests` stage collects its tests (passes/examples), which
# import it as the installed package it is meant to be.
if ! $PY -c "import kiln_example_pass" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e passes/examples/kiln-example-pass || exit 1
fi

# The GPU suite in five parts, one device command each: part A (stage tests_a), part C
# (tests_c), part D (tests_d), part E (tests_e), and part B (tests_b), every other file under tests/.
# (tests/test_moe.py went to part B on 2026-12-05: part A had reached 572 of its 580 s in
# AE1, and GPT-OSS's GPU tests, ~50 s in AF2, joined its files; on 2026-12-05 too part A's
# GEMV, MoE-kernel and runtime files became part C; its MoE-kernel file became part D when
# part C took 534 s on an H100 in AI3; the compile tests became part E when part B met its
# 580-s limit 3 tests short on an H100 in AM2, their cold compiles 324 s of its 574; part A's
# two kernel files went to part C when its architectures file alone took ~400 s there, AM3.)
SUITE_A=(tests/test_gpu_architectures.py)
SUITE_C=(tests/test_gpu_kernels.py tests/test_kernels_triton.py tests/test_kernels_triton_linear.py
         tests/test_runtime_engine_batching.py tests/test_runtime_sampler.py tests/test_gpu_tensor_parallel.py)
SUITE_D=(tests/test_moe_triton.py)
SUITE_E=(tests/test_compile_gpu.py)
# The suite's stages run their tests on GPU_TEST_WORKERS pytest-xdist processes (default 4;
# 1: one process, as until 2026-12-06) when xdist is importable (the wheels carry it: pass
# `pytest-xdist` to fetch-wheels.sh). Most of the suite's time is the host's (Triton and
# Inductor compiles, torch.export), which the device machine's 16 cores can do four at a time;
# the tests' tiny models leave the GPU's memory room for four engines (each sizes its KV cache
# by its own allocations and its configs' small max_model_len, not by the device's free memory).
GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-4}
GPU_PYTEST=($PY -m pytest -q -p no:cacheprovider -rfEs --durations=10 -m gpu)
if [ "$GPU_TEST_WORKERS" -gt 1 ] && $PY -c "import xdist" 2>/dev/null; then
  GPU_PYTEST+=(-n "$GPU_TEST_WORKERS")
fi

status=0
run_stage() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local start=$(date +%s)
  timeout --signal=INT "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc in $(( $(date +%s) - start ))s"
  grep -E '^\[|passed|failed|rror' "$OUT/$name.log" | tail -20
  [ $rc -eq 0 ] || status=1
}

# An A/B of bench/latency.py at batch 1 and 8: one run per entry of `order`, alternating, with
# `variable` set to the entry; with `on_value`, set to it for entry 1 and empty for 0 (for a
# variable whose value is a path). Each run: STAGE_<i>_<tag><entry>.log and .json.
latency_ab() {  # stage, tag, variable, order, on_value, more bench/latency.py arguments...
  # order: values of the variable, each also naming its run's files, or label:value entries
  # where the value would make an odd file name (KILN_PDL_EARLY_TRIGGER's comma lists)
  local stage=$1 tag=$2 var=$3 order=$4 on=$5 i=0 entry label value; shift 5
  for entry in $order; do
    i=$((i + 1))
    label=${entry%%:*} value=${entry#*:}
    [ -n "$on" ] && value=$([ "$value" = 1 ] && echo "$on" || true)
    run_stage "${stage}_${i}_$tag$label" 280 env "$var=$value" $PY bench/latency.py --batch-sizes 1,8 --steps 128 \
      --no-baseline "$@" --out "$OUT/${stage}_${i}_$tag$label.json"
  done
}
FP8_ONLY=(--quantization fp8 --kv-cache-dtype fp8 --quantized-only)

for stage in $STAGES; do
  case $stage in
    tests)  # the whole GPU suite in one command: with one process it no longer fit one (I5 reached 145
            # of 157 tests in ~515 s; ~1,500 s in AM1-AM3 on an H100); on GPU_TEST_WORKERS=4 processes 421 s
            # on an H100 (AN2: 617 passed, 10 skipped). The parts below are for a slower machine or one process
      run_stage tests 580 "${GPU_PYTEST[@]}" tests/ passes/examples ;;
    tests_a)  # the GPU suite, part A (~175 s in H3, 398 s in AA4, 320 s in AB2, 443 s on an H100 in AI1; since then the Triton kernel files' dual CPU/CUDA tests
             # are in -m gpu on a GPU too, test_kernels_triton.py alone 70 s in P6): the architectures file alone since AM3
      run_stage tests_a 580 "${GPU_PYTEST[@]}" "${SUITE_A[@]}" ;;
    tests_c)  # part C: the kernel files, the runtime's batching and sampler on CUDA, TP, the plugin (100 s on an H100 in AM1, before the kernel files of part A joined it)
      run_stage tests_c 580 "${GPU_PYTEST[@]}" "${SUITE_C[@]}" passes/examples ;;
    tests_d)  # part D: the MoE kernels (with part C 534 s on an H100 in AI3)
      run_stage tests_d 580 "${GPU_PYTEST[@]}" "${SUITE_D[@]}" ;;
    tests_e)  # part E: Inductor and graph-mode compiles on CUDA, cold then warm (324 s on an H100 in AM2)
      run_stage tests_e 580 "${GPU_PYTEST[@]}" "${SUITE_E[@]}" ;;
    tests_b)  # part B (~265 s in H4, 305 s in J6, 426 s in AA5, 307 s in AB3, 431 s on an H100 in AI2): every other GPU-marked file (compile on CUDA, CUDA graphs, engine, FP8, parity)
      run_stage tests_b 580 "${GPU_PYTEST[@]}" tests/ "${SUITE_A[@]/#/--ignore=}" \
        "${SUITE_C[@]/#/--ignore=}" "${SUITE_D[@]/#/--ignore=}" "${SUITE_E[@]/#/--ignore=}" ;;
    latency)
      run_stage latency 300 $PY bench/latency.py --batch-sizes 1,8,32,128 --steps 128 --hf-steps 8 \
        --prompt-len 128 --out "$OUT/latency.json" ;;
    latency_inductor)  # the same decode figures with Inductor artifacts (a 4-bucket plan: compiling the default one takes many minutes)
      run_stage latency_inductor 560 $PY bench/latency.py --batch-sizes 1,8,64 --steps 128 --no-baseline \
        --prompt-len 128 --compile inductor --decode-buckets 1,8,64 --token-buckets 2048 --max-num-batched-tokens 2048 \
        --cache-dir "$OUT/inductor-cache" --out "$OUT/latency_inductor.json" ;;
    latency_graph)  # the comparison run for latency_inductor: same plan, the default CUDA artifact
      run_stage latency_graph 300 $PY bench/latency.py --batch-sizes 1,8,64 --steps 128 --no-baseline \
        --prompt-len 128 --decode-buckets 1,8,64 --token-buckets 2048 --max-num-batched-tokens 2048 \
        --out "$OUT/latency_graph.json" ;;
    profile_inductor)  # kernel by kernel: the Inductor artifacts' decode step next to the graph's (profile)
      run_stage profile_inductor 400 $PY bench/profile_decode.py --batch-sizes 1,8 --steps 30 --compile inductor \
        --decode-buckets 1,8 --token-buckets 2048 --max-num-batched-tokens 2048 --cache-dir "$OUT/inductor-cache" \
        --out "$OUT/profile_inductor.json" ;;
    load_weights)  # a real safetensors checkpoint of the 8B shape: Kiln's load rate next to the disk's
      run_stage load_weights 400 $PY bench/load_weights.py --out "$OUT/load_weights.json" ;;
    throughput)
      run_stage throughput 300 $PY bench/throughput.py --hf-requests 64 --out "$OUT/throughput.json" ;;
    startup)
      run_stage startup 300 $PY bench/startup.py --out "$OUT/startup.json" ;;
    profile)
      run_stage profile 300 $PY bench/profile_decode.py --batch-sizes 1,8,32 --steps 30 --out "$OUT/profile.json" ;;
    profile_throughput)
      run_stage profile_throughput 300 $PY bench/profile_throughput.py --out "$OUT/profile_throughput.json" ;;
    tune_gemv)  # kiln::linear's GEMV tilings at the Llama-3-8B projections, 1 and 8 rows, weights past L2
      run_stage tune_gemv 400 $PY bench/tune_gemv.py --out "$OUT/tune_gemv.json" ;;
    tune_gemv_split_k)  # FP8 GEMVs with K split inside one launch (GemvConfig.split_k), the narrow projections
      run_stage tune_gemv_split_k 400 $PY bench/tune_gemv.py --fp8 --rows 8,1 --shapes o,down,qkv --sweep split_k \
        --out "$OUT/tune_gemv_split_k.json" ;;
    tune_gemv_swap)  # FP8 GEMVs at 1 and 8 rows with the weight as the MMA's rows (GemvConfig.swap_ab), after its test
      run_stage tune_gemv_swap_test 120 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_triton_linear.py \
        -k "weight_as_the_mma_rows"
      run_stage tune_gemv_swap 540 $PY bench/tune_gemv.py --fp8 --rows 1,8 --shapes o,down,qkv --sweep swap \
        --out "$OUT/tune_gemv_swap.json" ;;
    tune_gemv_narrow)  # FP8 GEMVs at 8 and 16 rows, the 64-row tile on 16 columns or with deep pipelines
      run_stage tune_gemv_narrow 400 $PY bench/tune_gemv.py --fp8 --rows 8,16 --shapes o,down,qkv --sweep narrow \
        --out "$OUT/tune_gemv_narrow.json" ;;
    tune_gemv_wide)  # FP8 GEMVs at eight rows with the 64-row tile (warpgroup MMA) only
      run_stage tune_gemv_wide 400 $PY bench/tune_gemv.py --fp8 --rows 8 --shapes o,down,gate_up,qkv --sweep wide \
        --out "$OUT/tune_gemv_wide.json" ;;
    split_k_tests)  # the split-K GEMV on CUDA: against the reference, and replayed from a CUDA graph
      run_stage split_k_tests 200 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_kernels_triton_linear.py -k split_k ;;
    l2_prefetch)  # would prefetching the next FP8 GEMV's weight into L2 beside a latency-bound kernel pay?
      run_stage l2_prefetch 300 $PY bench/l2_prefetch.py --out "$OUT/l2_prefetch.json" ;;
    tune_gemv_fp8)  # kiln::fp8_linear's FP8 GEMV tilings at the same projections (the LM head stays bf16)
      run_stage tune_gemv_fp8 400 $PY bench/tune_gemv.py --fp8 --shapes qkv,o,gate_up,down --out "$OUT/tune_gemv_fp8.json" ;;
    tune_attention)
      run_stage tune_attention 300 $PY bench/tune_attention.py --out "$OUT/tune_attention.json" ;;
    tune_attention_fp8)  # issue 16: the same over an e4m3 cache (f16 dots; 256-key decode tiles too)
      run_stage tune_attention_fp8 360 $PY bench/tune_attention.py --kv-cache-dtype fp8 --out "$OUT/tune_attention_fp8.json" ;;
    fp8_tests)  # issue 16: the FP8 kernels at real shapes, the FP8 engine under CUDA graphs
      run_stage fp8_tests 560 $PY -m pytest -q -p no:cacheprovider -rfEs -s -m gpu tests/test_gpu_fp8.py ;;
    fp8_gemm)  # _scaled_mm vs the Triton FP8 GEMV vs bf16, Llama-3-8B projections
      run_stage fp8_gemm 300 $PY bench/fp8_gemm.py --out "$OUT/fp8_gemm.json" ;;
    fp8_latency)  # bf16, then FP8 weights + FP8 KV, in one run
      run_stage fp8_latency 560 $PY bench/latency.py --batch-sizes 1,8,32,128 --steps 128 --no-baseline \
        --quantization fp8 --kv-cache-dtype fp8 --out "$OUT/fp8_latency.json" ;;
    pdl_ab)  # decode at batch 1 and 8, bf16 then FP8 + FP8 KV, with programmatic dependent launch off and on,
             # in the order of PDL_AB_ORDER (default "0 1 0 1")
      latency_ab pdl_ab pdl KILN_PDL "${PDL_AB_ORDER:-0 1 0 1}" "" --quantization fp8 --kv-cache-dtype fp8 ;;
    fused_combine_ab)  # FP8 + FP8 KV decode at batch 1 and 8 with the split decode merging its own splits
                       # off and on (KILN_ATTENTION_FUSED_COMBINE), in the order of FUSED_COMBINE_AB_ORDER
                       # (default "0 1 0 1"), after its kernel test on CUDA
      run_stage fused_combine_test 200 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
        -k "merges_its_own_splits or keys_as_rows or needs_no_fill"
      latency_ab fused_combine_ab fused KILN_ATTENTION_FUSED_COMBINE "${FUSED_COMBINE_AB_ORDER:-0 1 0 1}" "" \
        "${FP8_ONLY[@]}" ;;
    gemv_tuned_ab)  # FP8 + FP8 KV decode at batch 1 and 8 with a tune_gemv sweep's winners (KILN_FP8_GEMV_TUNED=
                    # $GEMV_TUNED, a bench/tune_gemv.py --fp8 result) off and on, order GEMV_TUNED_AB_ORDER ("0 1 0 1")
      [ -f "${GEMV_TUNED:-}" ] || { echo "gemv_tuned_ab: set GEMV_TUNED to a bench/tune_gemv.py --fp8 result"; status=2; continue; }
      latency_ab gemv_tuned_ab tuned KILN_FP8_GEMV_TUNED "${GEMV_TUNED_AB_ORDER:-0 1 0 1}" "$GEMV_TUNED" "${FP8_ONLY[@]}" ;;
    small_rows_16bit_ab)  # bf16 decode at batch 1 and 8 with small-batch decodes on the keys-as-rows kernel
                          # off and on (KILN_ATTENTION_SMALL_DECODE_ROWS_16BIT=0 / 128), order "0 128 0 128"
      latency_ab small_rows_16bit_ab keys KILN_ATTENTION_SMALL_DECODE_ROWS_16BIT "${SMALL_ROWS_16BIT_AB_ORDER:-0 128 0 128}" "" ;;
    norm_early_weight_ab)  # the RMSNorm kernels' weight loaded before the PDL wait (KILN_NORM_EARLY_WEIGHT): its
                           # test on CUDA, then FP8 + FP8 KV and bf16 decode at batch 1 and 8, off / on alternating
      run_stage norm_early_weight_test 200 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
        -k "norm_weight_loaded_early or rms_norm"
      latency_ab norm_early_weight_ab fp8w KILN_NORM_EARLY_WEIGHT "${NORM_EARLY_WEIGHT_AB_ORDER:-0 1 0 1}" "" "${FP8_ONLY[@]}"
      latency_ab norm_early_weight_ab bf16w KILN_NORM_EARLY_WEIGHT "${NORM_EARLY_WEIGHT_AB_ORDER:-0 1 0 1}" "" ;;
    fused_rope_ab)  # RoPE and the new tokens' cache write inside the keys-as-rows decode kernel
                    # (KILN_ATTENTION_FUSED_ROPE): its kernel tests on CUDA, the bf16 parity and FP8 tests with
                    # it on, then FP8 + FP8 KV and bf16 decode at batch 1 and 8, off / on alternating (~8 min)
      run_stage fused_rope_test 200 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
        -k "rope or keys_as_rows or rows_over or merges_its_own"
      KILN_ATTENTION_FUSED_ROPE=1 run_stage fused_rope_parity 300 $PY -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_gpu_fusion_parity.py tests/test_gpu_fp8.py -k "bfloat16 or fp8"
      latency_ab fused_rope_ab fp8w KILN_ATTENTION_FUSED_ROPE "${FUSED_ROPE_AB_ORDER:-0 1 0 1}" "" "${FP8_ONLY[@]}"
      latency_ab fused_rope_ab bf16w KILN_ATTENTION_FUSED_ROPE "${FUSED_ROPE_AB_ORDER:-0 1 0 1}" "" ;;
    one_writer_ab)  # the fused RoPE's new keys written only by the split programs that read them
                    # (KILN_ATTENTION_NEW_KV_ONE_WRITER): its tests on CUDA, then FP8 + FP8 KV and bf16 decode at
                    # batch 1 and 8, off / on alternating (~6 min)
      run_stage one_writer_test 200 env KILN_ATTENTION_NEW_KV_ONE_WRITER=1 $PY -m pytest -q -p no:cacheprovider \
        tests/test_kernels_triton.py -k "rotates_and_writes or only_splits or keys_as_rows"
      latency_ab one_writer_ab fp8w KILN_ATTENTION_NEW_KV_ONE_WRITER "${ONE_WRITER_AB_ORDER:-0 1 0 1}" "" "${FP8_ONLY[@]}"
      latency_ab one_writer_ab bf16w KILN_ATTENTION_NEW_KV_ONE_WRITER "${ONE_WRITER_AB_ORDER:-0 1 0 1}" "" ;;
    fused_rope_norms_ab)  # Qwen3's q/k norms in the keys-as-rows decode kernel too (KILN_ATTENTION_FUSED_ROPE_NORMS):
                          # its tests on CUDA, then Qwen3-8B-shaped bf16 and FP8 + FP8 KV decode at batch 1 and 8,
                          # off / on alternating (~7 min; the variable is the fewest decode tokens fused, 0 never,
                          # default 2: FUSED_ROPE_NORMS_AB_ORDER="0 2 1 2" times the default against both)
      run_stage fused_rope_norms_test 200 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
        -k "rotates_and_writes or rope"
      KILN_ATTENTION_FUSED_ROPE_NORMS=1 run_stage fused_rope_norms_parity 200 $PY -m pytest -q -p no:cacheprovider \
        -m gpu tests/test_gpu_fusion_parity.py -k "bfloat16 and qwen3"
      latency_ab fused_rope_norms_ab bf16w KILN_ATTENTION_FUSED_ROPE_NORMS "${FUSED_ROPE_NORMS_AB_ORDER:-0 1 0 1}" "" \
        --model bench/qwen3_8b.json
      latency_ab fused_rope_norms_ab fp8w KILN_ATTENTION_FUSED_ROPE_NORMS "${FUSED_ROPE_NORMS_AB_ORDER:-0 1 0 1}" "" \
        --model bench/qwen3_8b.json "${FP8_ONLY[@]}" ;;
    pdl_trigger_tests)  # the early PDL trigger's tests on CUDA with it in every kernel: the PDL chain graph, the
                        # fused and plain FP8 GEMVs, the FP8 engine (~2.5 min; its own device command)
      run_stage pdl_trigger_tests 400 env KILN_PDL_EARLY_TRIGGER=1 $PY -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_kernels_triton.py tests/test_fp8_fused_linear.py tests/test_gpu_fp8.py -k "pdl or fused or fp8" ;;
    pdl_trigger_families_ab)  # which kernels' early PDL trigger makes bf16 decode's +1.7% at batch 1 (AA2, every
                              # kernel) and which FP8's -2.1% at batch 8: bf16, then FP8 + FP8 KV decode at batch
                              # 1 and 8 with KILN_PDL_EARLY_TRIGGER none / linear / the small kernels, twice (~7 min)
      order=${PDL_FAMILIES_AB_ORDER:-none:0 linear:linear small:norm,rope,attention,activation none:0 linear:linear small:norm,rope,attention,activation}
      latency_ab pdl_trigger_families_ab bf16_ KILN_PDL_EARLY_TRIGGER "$order" ""
      latency_ab pdl_trigger_families_ab fp8_ KILN_PDL_EARLY_TRIGGER "$order" "" "${FP8_ONLY[@]}" ;;
    pdl_fp8_quant_ab)  # FP8 + FP8 KV decode at batch 1 and 8 with the early PDL trigger in the default's small
                       # kernels and also in FP8's quantizing ones (fp8_quant: the quantizing norm, SiLU-and-mul,
                       # per-token quantization), alternating, twice (~2.5 min): the FP8 model's counterpart of
                       # bf16's +2.4% at batch 1 from the small kernels (AB1)
      latency_ab pdl_fp8_quant_ab "" KILN_PDL_EARLY_TRIGGER "${PDL_FP8_QUANT_AB_ORDER:-default:norm,rope,attention,activation quant:norm,rope,attention,activation,fp8_quant default:norm,rope,attention,activation quant:norm,rope,attention,activation,fp8_quant}" "" "${FP8_ONLY[@]}" ;;
    fp8_throughput)  # bf16, then FP8 weights + FP8 KV, in one run (~3 min)
      run_stage fp8_throughput 560 $PY bench/throughput.py --no-baseline --quantization fp8 --kv-cache-dtype fp8 \
        --out "$OUT/fp8_throughput.json" ;;
    fp8_fast_accum)  # issue 16: the FP8 offline run with _scaled_mm's fast accumulation off, then on (the default)
      KILN_FP8_FAST_ACCUM=0 run_stage fp8_fast_accum_off 300 $PY bench/throughput.py --no-baseline --quantization fp8 \
        --kv-cache-dtype fp8 --quantized-only --out "$OUT/fp8_fast_accum_off.json"
      KILN_FP8_FAST_ACCUM=1 run_stage fp8_fast_accum_on 300 $PY bench/throughput.py --no-baseline --quantization fp8 \
        --kv-cache-dtype fp8 --quantized-only --out "$OUT/fp8_fast_accum_on.json" ;;
    overlap)  # issue 16: does a ~1,000-sequence decode step gain from two nano-batches on two streams?
      run_stage overlap 200 $PY bench/overlap.py --out "$OUT/overlap.json" ;;
    fp8_profile)
      run_stage fp8_profile 300 $PY bench/profile_decode.py --batch-sizes 1,8 --steps 30 --quantization fp8 \
        --kv-cache-dtype fp8 --out "$OUT/fp8_profile.json" ;;
    fp8_profile_throughput)
      run_stage fp8_profile_throughput 300 $PY bench/profile_throughput.py --quantization fp8 --kv-cache-dtype fp8 \
        --out "$OUT/fp8_profile_throughput.json" ;;
    moe_tests)  # issue 17: fused_moe's Triton kernel at real shapes, MoE parity through the CUDA pipeline
      run_stage moe_tests 560 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_moe_triton.py tests/test_moe.py ;;
    moe_mixtral_decode)
      run_stage moe_mixtral_decode 560 $PY bench/moe.py --shape mixtral-8x7b --no-offline ${MOE_ARGS:-} --out "$OUT/moe_mixtral_decode.json" ;;
    moe_mixtral_offline)
      run_stage moe_mixtral_offline 560 $PY bench/moe.py --shape mixtral-8x7b --no-decode ${MOE_ARGS:-} --out "$OUT/moe_mixtral_offline.json" ;;
    moe_tma_ab)  # issue 17: fused_moe's sorted-rows (tensor descriptor) kernels: their tests on CUDA, their tilings
                 # at Mixtral's decode and prefill step sizes, then the Mixtral offline run with them
                 # (KILN_MOE_TMA_MIN_ROWS=${MOE_TMA_MIN_ROWS:-1} rows per expert) and without; ~7 min
      run_stage moe_tma_tests 120 $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_moe_triton.py -k sorted_rows
      run_stage moe_tma_tune 200 $PY bench/tune_moe.py ${MOE_TMA_TUNE_ARGS:---shapes mixtral-8x7b --tokens 320,2048,16384} \
        --sweeps tma --out "$OUT/moe_tma_tune.json"
      for min_rows in ${MOE_TMA_MIN_ROWS:-1} 0; do
        run_stage "moe_tma_offline_$min_rows" 200 env KILN_MOE_TMA_MIN_ROWS="$min_rows" $PY bench/moe.py \
          --shape mixtral-8x7b --no-decode --no-baseline ${MOE_ARGS:-} --out "$OUT/moe_tma_offline_$min_rows.json"
      done ;;
    moe_parts)  # issue 17: fused_moe's gate/up and down tilings swept apart (the tables give both one tiling) at
                # Mixtral's offline decode (320 tokens) and prefill (16,384) step sizes; ~3 min
      run_stage moe_parts 400 $PY bench/tune_moe.py --shapes mixtral-8x7b --tokens ${MOE_PARTS_TOKENS:-320,16384} \
        --sweeps gate_up,down --out "$OUT/moe_parts.json" ;;
    moe_grouping_ab)  # issue 17: fused_moe's pair grouping in one kernel against ~20 torch ops: fused_moe_triton's
                      # tests on CUDA (~150 s), the grouping alone and in the op, then the Mixtral offline run
                      # with and without it (KILN_MOE_GROUPING_KERNEL_MAX_PAIRS per MOE_GROUPING_ORDER, default
                      # "8192 0"; MOE_GROUPING_TESTS=0 skips the tests); ~7 min
      [ "${MOE_GROUPING_TESTS:-1}" = 0 ] || run_stage moe_grouping_tests 240 $PY -m pytest -q -p no:cacheprovider -rfEs \
        tests/test_moe_triton.py
      run_stage moe_grouping_tune 120 $PY bench/tune_moe.py --tokens 8,64,320,2048 --sweeps grouping \
        --out "$OUT/moe_grouping_tune.json"
      i=0
      for max_pairs in ${MOE_GROUPING_ORDER:-8192 0}; do
        i=$((i + 1))
        run_stage "moe_grouping_offline_${i}_$max_pairs" 200 env KILN_MOE_GROUPING_KERNEL_MAX_PAIRS="$max_pairs" $PY \
          bench/moe.py --shape mixtral-8x7b --no-decode --no-baseline ${MOE_ARGS:-} \
          --out "$OUT/moe_grouping_offline_${i}_$max_pairs.json"
      done ;;
    moe_fp8_experts)  # issues 16/17: FP8 MoE experts (the default of --quantization fp8 since 2026-12-06): their kernel tests on
                      # CUDA, then the Mixtral shape with --quantization fp8, decode 1/64 and the offline run; ~7 min
      run_stage moe_fp8_experts_tests 200 $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_moe_triton.py \
        -k "fp8_experts or quantizing_stacked or fp8_activations"
      run_stage moe_fp8_experts 400 $PY bench/moe.py --shape mixtral-8x7b --no-baseline \
        --quantization fp8 ${MOE_ARGS:-} --out "$OUT/moe_fp8_experts.json" ;;
    w8a8_defaults)  # issues 16/17: the forty-eighth session's W8A8 MoE defaults (from 24 rows an expert, 128-deep K
                    # tiles, the input quantized in expert order in one launch) on CUDA: their tests, one layer per
                    # shape against AM1's figures, Qwen3-MoE's FP8 offline run against AM4's 9,752; ~7 min on an H100
      run_stage w8a8_tests 240 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_moe_triton.py \
        tests/test_gpu_fp8.py tests/test_kernels_triton.py -k "fp8_activations or w8a8 or sorted_rows or quantize_fp8 or moe_experts_in_fp8"
      run_stage w8a8_tune 200 $PY bench/tune_moe.py --shapes mixtral-8x7b,qwen3-moe-30b-a3b,glm-4.5-air,deepseek-v2-lite \
        --tokens 64,128,256,512,2048 --sweeps fp8 --out "$OUT/w8a8_tune.json"
      run_stage w8a8_qwen3_offline 150 $PY bench/moe.py --shape qwen3-moe-30b-a3b --offline --no-decode --no-baseline \
        --quantization fp8 --out "$OUT/w8a8_qwen3_offline.json" ;;
    moe_mixtral_budgets)  # issue 17: the Mixtral offline run at smaller step token budgets (max_num_batched_tokens),
                          # whose decode steps, bound by reading every expert, could take prefill chunks nearly free
                          # (bench/simulate_scheduler.py --cost roofline: 1,024 +5% if host work stays hidden); ~6 min
      for budget in ${MIXTRAL_BUDGETS:-1024 16384 2048}; do
        run_stage "moe_mixtral_budget_$budget" 300 $PY bench/moe.py --shape mixtral-8x7b --no-decode --no-baseline \
          --max-num-batched-tokens "$budget" ${MOE_ARGS:-} --out "$OUT/moe_mixtral_budget_$budget.json"
      done ;;
    bf16_budgets)  # issue 16: the bf16 offline run (Llama-3-8B shape) at step token budgets 2,048 and 16,384 (the
                   # default), twice, alternating (the simulation: no gain); ~5 min
      i=0
      for budget in ${BF16_BUDGETS:-2048 16384 2048 16384}; do
        i=$((i + 1))
        run_stage "bf16_budget_${i}_$budget" 200 $PY bench/throughput.py --no-baseline --max-num-batched-tokens "$budget" \
          --out "$OUT/bf16_budget_${i}_$budget.json"
      done ;;
    moe_profile_throughput)  # where the Mixtral offline run's time goes (kernels of 6 mixed steps)
      # (MOE_PROFILE_ARGS="--max-num-batched-tokens 1024": the steps of AB4's losing budget)
      run_stage moe_profile_throughput 560 $PY bench/profile_throughput.py --model bench/mixtral_8x7b.json \
        ${MOE_PROFILE_ARGS:-} --out "$OUT/moe_profile_throughput.json" ;;
    tune_moe)  # fused_moe's tilings at the Mixtral and Qwen3-MoE shapes, decode and prefill step sizes
      run_stage tune_moe 560 $PY bench/tune_moe.py ${TUNE_MOE_ARGS:-} --out "$OUT/tune_moe.json" ;;
    moe_qwen3)
      run_stage moe_qwen3 560 $PY bench/moe.py --shape qwen3-moe-30b-a3b --out "$OUT/moe_qwen3.json" ;;
    moe_routers)  # issue 17: kiln::moe_experts behind other routers, MLA; GLM-4.5's float32 router in bf16
      run_stage moe_routers 560 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_gpu_architectures.py \
        -k "moe or ernie or minimax or granitemoe or deepseek or lite or float32_router" ;;
    moe_deepseek_v2_lite)  # issue 17: MLA (cached expanded) + moe_experts at DeepSeek-V2-Lite's shape, decode 1/64
      run_stage moe_deepseek_v2_lite 560 $PY bench/moe.py --shape deepseek-v2-lite --no-offline ${MOE_ARGS:-} \
        --out "$OUT/moe_deepseek_v2_lite.json" ;;
    tune_latent)  # the latent kernel's launch shapes at DeepSeek-V2-Lite's attention, against the general kernel's
      # (TUNE_LATENT_ARGS="--kv-cache-dtype fp8 --decode-seqs 64,256" for the FP8 cache's tilings)
      run_stage tune_latent 400 $PY bench/tune_latent_attention.py ${TUNE_LATENT_ARGS:-} --out "$OUT/tune_latent.json" ;;
    latent_kernel_ab)  # issue 17: DeepSeek-V2-Lite's decode 1/64 over its latent on the latent kernel (512 + 64
                       # columns, each key read once) against the general kernel's LATENT_TILING (1,024 padded),
                       # alternating, two runs each (~4 min); then the latent kernel tests on CUDA
      for i in 1 2; do
        for on in 0 1; do
          KILN_LATENT_KERNEL=$on run_stage latent_kernel_ab_${i}_kernel$on 200 $PY bench/moe.py --shape deepseek-v2-lite \
            --no-offline --no-baseline --out "$OUT/latent_kernel_ab_${i}_kernel$on.json"
        done
      done
      run_stage latent_kernel_tests 200 $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_kernels_triton.py -k latent ;;
    gpt_oss_tests)  # GPT-OSS: attention sinks in the attention kernel, biased experts with the clamped SwiGLU in
                    # the MoE kernels' epilogues, the tiny model through Triton + CUDA graphs (~2 min)
      run_stage gpt_oss_tests 300 $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_gpu_architectures.py \
        tests/test_kernels_triton.py tests/test_moe_triton.py -k "gpt_oss or sinks or biased" ;;
    moe_gpt_oss_20b)  # GPT-OSS-20B's shape (dummy bf16, ~41 GB): decode 1/64 against Hugging Face eager
      run_stage moe_gpt_oss_20b 560 $PY bench/moe.py --shape gpt-oss-20b --no-offline ${MOE_ARGS:-} \
        --out "$OUT/moe_gpt_oss_20b.json" ;;
    mamba_latency)  # Falcon-Mamba-7B's shape (dummy bf16, ~14.5 GB; 64 selective-scan layers, no attention): decode
                    # batch 1 / 8 / 64 on the selective-scan and conv kernels, Hugging Face eager (its torch scan) in the same run
      run_stage mamba_latency 300 $PY bench/latency.py --model bench/falcon_mamba_7b.json --batch-sizes 1,8,64 \
        --steps 128 --hf-steps 4 --out "$OUT/mamba_latency.json" ;;
    olmo2_latency)  # OLMo-2-7B's shape (dummy bf16, ~15 GB; float32 cos/sin: its RoPE folded into the attention
                    # since the forty-third session) at decode batch 1 / 8, Hugging Face eager in the same run
      run_stage olmo2_latency 300 $PY bench/latency.py --model bench/olmo2_7b.json --batch-sizes 1,8 --steps 128 \
        --hf-steps 8 --out "$OUT/olmo2_latency.json" ;;
    moe_qwen3_next)  # Qwen3-Next-80B's shape (dummy, FP8 with FP8 experts, ~81 GB; gated DeltaNet states): decode 1/64
      run_stage moe_qwen3_next 560 $PY bench/moe.py --shape qwen3-next-80b --no-offline \
        --no-baseline --quantization fp8 ${MOE_ARGS:-} --out "$OUT/moe_qwen3_next.json" ;;
    moe_llama4_scout)  # Llama 4 Scout's language model (dummy, FP8 with FP8 experts, ~108 GB): decode 1/64, no baseline
      run_stage moe_llama4_scout 560 $PY bench/moe.py --shape llama4-scout --no-offline \
        --no-baseline --quantization fp8 ${MOE_ARGS:-} --out "$OUT/moe_llama4_scout.json" ;;
    arch_tests)  # issue 18: soft-capping, ALiBi, partial rotary, parallel blocks through Triton + CUDA graphs
      run_stage arch_tests 560 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_gpu_architectures.py \
        tests/test_kernels_triton.py ;;
    tp_tests)  # issues 14/15: one-shot all-reduce, TP=2 greedy = TP=1, killed worker, serve -tp 2 (2 GPUs)
      run_stage tp_tests 400 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_gpu_tensor_parallel.py ;;
    tp1_before_after)  # issue 14: TP=1 decode 1/8/64 before tensor parallelism (.before/SHA.tar) and at this tree, one run
      run_stage tp1_before_after 400 bash bench/compare_commits.sh bench/latency.py --batch-sizes 1,8,64 --steps 128 \
        --no-baseline --prompt-len 128 ;;
    allreduce)  # issue 15: NCCL vs the one-shot all-reduce per message size, eager and in a CUDA graph
      run_stage allreduce 90 $PY bench/allreduce.py --out "$OUT/allreduce.json" ;;
    tp70b)  # issue 15: Llama-3-70B shape at TP=2: decode 1/8/64, then the 1,000-request offline workload
      run_stage tp70b ${TP70B_LIMIT:-330} $PY bench/tp.py --model bench/llama3_70b.json --tensor-parallel-sizes 2 \
        --batch-sizes 1,8,64 --steps 64 --decode-buckets 1,2,4,8,16,32,64,128,256 --token-buckets 1024,4096,8192 \
        --no-baseline --out "$OUT/tp70b.json" ;;
    fp8_70b)  # issue 16: the Llama-3-70B shape in FP8 on ONE H200 (70 GB of e4m3: each weight quantized as it loads,
              # the 140 GB of bf16 never all on the device), FP8 KV cache; decode 1/8/64, no baseline (bf16 does not fit)
      run_stage fp8_70b ${FP8_70B_LIMIT:-400} $PY bench/latency.py --model bench/llama3_70b.json --batch-sizes 1,8,64 \
        --steps 64 --no-baseline --quantization fp8 --kv-cache-dtype fp8 --quantized-only --out "$OUT/fp8_70b.json" ;;
    tp70b_fp8)  # issues 15/16: Llama-3-70B shape at TP=2 in FP8 (each rank quantizes its slices as they load, FP8 KV
                # cache calibrated per rank): decode 1/8/64, then the offline workload (2 GPUs)
      run_stage tp70b_fp8 ${TP70B_LIMIT:-330} $PY bench/tp.py --model bench/llama3_70b.json --tensor-parallel-sizes 2 \
        --batch-sizes 1,8,64 --steps 64 --decode-buckets 1,2,4,8,16,32,64,128,256 --token-buckets 1024,4096,8192 \
        --quantization fp8 --kv-cache-dtype fp8 --no-baseline --out "$OUT/tp70b_fp8.json" ;;
    tp8b)  # issue 15: Llama-3-8B shape, TP=1 vs TP=2 (NCCL) vs TP=2 (one-shot all-reduce), decode 1/8/64
      run_stage tp8b ${TP8B_LIMIT:-200} $PY bench/tp.py --model bench/llama3_8b.json --tensor-parallel-sizes 1,2 --one-shot-too \
        --batch-sizes 1,8,64 --steps 64 --decode-buckets 1,8,64 --token-buckets 1024,8192 --num-requests 0 \
        --no-baseline --out "$OUT/tp8b.json" ;;
    serve)  # issue 16: the QPS / P99 table (Llama-3-8B shape, dummy weights, SmolLM2 tokenizer); the
            # JSON is rewritten after every rate, so a stage cut at its limit keeps the rates it finished
      run_stage serve 580 $PY bench/serve.py --preset h200-llama3-8b --out "$OUT/serve.json" ;;
    serve_fp8)  # the same with FP8 weights and KV cache (needs the FP8 path: --quantization, --kv-cache-dtype)
      run_stage serve_fp8 580 $PY bench/serve.py --preset h200-llama3-8b --quantization fp8 --kv-cache-dtype fp8 \
        --out "$OUT/serve_fp8.json" ;;
    serve_mixed_graphs_ab)  # the serving table's setting at two rates (SERVE_AB_RATES, default 8,16) with the
                            # mixed-step CUDA graphs at 512 tokens, then off (--cuda-graph-mixed-tokens; ~8 min)
      for tokens in ${SERVE_AB_ORDER:-512 0}; do
        run_stage "serve_mixed_graphs_$tokens" 280 $PY bench/serve.py --preset h200-llama3-8b --no-baseline \
          --rates "${SERVE_AB_RATES:-8,16}" --serve-arg=--cuda-graph-mixed-tokens="$tokens" \
          --out "$OUT/serve_mixed_graphs_$tokens.json"
      done ;;
    profile_capture)  # where a warm start's CUDA-graph capture goes, per graph and function, with the mixed-step
                      # graphs (CAPTURE_MIXED_TOKENS, default 512; AR1: ~0.07 s each profiled, like a decode graph)
      run_stage profile_capture 400 $PY bench/profile_capture.py --cuda-graph-mixed-tokens "${CAPTURE_MIXED_TOKENS:-512}" \
        --out "$OUT/profile_capture.json" ;;
    serve_plot)
      run_stage serve_plot 120 $PY bench/plot_results.py --serve $(ls "$OUT"/serve.json "$OUT"/serve_fp8.json 2>/dev/null) \
        --out "$OUT/serve.png" ;;
    *)
      echo "unknown stage $stage: the stages are listed at the top of bench/gpu_smoke.sh"; status=2 ;;
  esac
done
# A device command brings back at most 8 files from $OUT (the device README's limits): with
# more, the files directly under it go back as one archive instead (gpu-out.tar.gz).
(cd "$OUT" && find . -maxdepth 1 -type f ! -name gpu-out.tar.gz -printf '%P\n') > /tmp/gpu-out.list
count=$(wc -l < /tmp/gpu-out.list)
if [ "$count" -gt 8 ]; then
  (cd "$OUT" && tar -czf gpu-out.tar.gz -T /tmp/gpu-out.list && xargs -d '\n' rm -f < /tmp/gpu-out.list) \
    && echo "=== $count files under \$OUT: bundled into gpu-out.tar.gz"
fi
exit $status
