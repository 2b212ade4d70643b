"""Kernel variants first built without a GPU (the swap GEMV, since timed and the FP8 table's
2-16-row tiling; the decode kernel's in-kernel combine and the fused 2-16-row FP8 GEMVs, off
by default) compile for an H100/H200 (sm_90) with the instructions they are meant to use.
The interpreter runs them on CPU (their numerics are tested beside them), but it runs
Python, not Triton's compiler: code that only a compile rejects (the swap GEMV's first
version built its early return's other branch with the wrong shapes) would otherwise first
fail in a device session. Compiling needs no GPU (Triton ships ptxas), only a fresh process
that defines the kernels without the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels.triton_fp8 import _fp8_gemv_dot_kernel
from kiln.kernels.triton_fp8_fused_linear import _fused_gemv_rows_kernel, fused_gemv_config
from kiln.kernels.triton_paged_decode_fp8 import _paged_decode_fp8_kernel

def compiled(fn, consts, types, num_warps, num_stages):
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # Multiples of 16, as Triton's launcher specializes them at the Llama shapes: pointers,
    # strides, and the GEMVs' N and K (without K's, no load of a weight tile is known to be
    # aligned, and nothing is pipelined: stages then change nothing).
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)

def ptx(fn, consts, types, num_warps, num_stages):
    return compiled(fn, consts, types, num_warps, num_stages).asm["ptx"]

found = {}
gemv_types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16",
              "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
for block_n, split_k in ((64, 1), (128, 2)):
    code = ptx(_fp8_gemv_dot_kernel, dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, SPLIT_K=split_k,
                                          PDL=True, EARLY_TILE=True, SWAP_AB=True), gemv_types, 4, 3)
    found[f"gemv swap {block_n} split {split_k}"] = sorted(set(re.findall(r"wgmma\\.mma_async[.\\w]*", code)))
for e4m3 in (True, False):
    cache = "*fp8e4nv" if e4m3 else "*bf16"
    types = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": "*bf16", "part_out_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "count_ptr": "*i32", "kv_scale_ptr": "*fp32", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "scale": "fp32"}
    for combine in (False, True):
        consts = dict(KV_SCALE=e4m3, GROUP=4, COLS=8, BLOCK_N=128, HEAD_DIM=128, CACHE_BLOCK=16, NUM_SPLITS=4,
                      WIDEN_ASM=e4m3, SINGLE_TOKENS_ONLY=False, HEADS_FASTEST=True, E4M3=e4m3, COMBINE=combine,
                      PDL=True)
        code = ptx(_paged_decode_fp8_kernel, consts, types, 4, 1)
        found[f"decode e4m3={e4m3} combine={combine}"] = sorted(set(re.findall(r"atom\\.[.\\w]*", code)))
# The fused 2-16-row GEMVs (KILN_FP8_FUSED_GEMV_ROWS, on in this process), each producer at
# the tiling it gets at eight rows on an H200 (227 KB of shared memory) for the projection it
# feeds: (prologue, N, K) = plain o, SiLU-and-mul down, RMSNorm qkv, add+RMSNorm qkv and gate/up.
fused_types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "g_ptr": "*bf16", "sum_ptr": "*bf16", "w_ptr": "*fp8e4nv",
               "ws_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "eps": "fp32"}
for prologue, n, k in ((0, 4096, 4096), (3, 4096, 14336), (1, 6144, 4096), (2, 6144, 4096), (2, 28672, 4096)):
    config = fused_gemv_config(n, k, 8, shared_memory=227 * 1024, inputs=2 if prologue in (2, 3) else 1)
    kernel = compiled(_fused_gemv_rows_kernel, dict(PROLOGUE=prologue, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=config.block_n,
                                                   BLOCK_K=config.block_k, FP8_MAX_C=448.0, MIN_SCALE_C=1e-12, PDL=True,
                                                   EARLY_TILE=True), fused_types, config.num_warps, config.num_stages)
    code = kernel.asm["ptx"]
    found[f"fused rows {prologue} {n}"] = {"mma": sorted(set(re.findall(r"wgmma\\.mma_async[.\\w]*", code))),
                                          "local": len(re.findall(r"\\.local", code)), "shared": kernel.metadata.shared}
print(json.dumps(found))
"""


def test_untimed_kernel_variants_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KILN_FP8_FUSED_GEMV_ROWS"] = "1"
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences Triton's warning; the kernels do not depend on it)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    # GemvConfig.swap_ab: the weight tile as a warpgroup MMA's 64 rows, x's rows as its 16
    # columns, both e4m3 as loaded (a 128-column tile: two such MMAs a K step).
    for variant in ("gemv swap 64 split 1", "gemv swap 128 split 2"):
        assert found[variant] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"], (variant, found[variant])
    # The fused 2-16-row GEMVs: the same MMA (each K tile's rows quantized to e4m3 in the
    # kernel), no spills to local memory, shared memory within an H100/H200's 227 KB (down at
    # 4 stages of 512-wide K tiles needed 232 KB: the table gives it 3).
    for prologue, n in ((0, 4096), (3, 4096), (1, 6144), (2, 6144), (2, 28672)):
        variant = found[f"fused rows {prologue} {n}"]
        assert variant["mma"] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"], variant
        assert variant["local"] == 0 and variant["shared"] <= 227 * 1024, variant
    # KILN_ATTENTION_FUSED_COMBINE: one atomic a program (its arrival), none without it.
    for e4m3 in (True, False):
        assert found[f"decode e4m3={e4m3} combine=False"] == [], found
        assert len(found[f"decode e4m3={e4m3} combine=True"]) == 1, found
