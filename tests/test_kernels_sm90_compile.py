"""Kernel variants first built without a GPU (the swap GEMV, since timed and the FP8 table's
2-16-row tiling; the decode kernel's in-kernel combine, one-writer and q/k-norm variants,
off by default; its fused RoPE and the RMSNorm kernels' early weight load, since timed; the
early PDL trigger, since timed and the small kernels' default; fused MoE's sorted-rows kernels
as refactored after their timing, its one-program grouping) compile for an H100/H200 (sm_90)
with the instructions they are meant to use. The interpreter runs them on CPU (their
numerics are tested beside them), but it runs Python, not Triton's compiler: code that only a
compile rejects (the swap GEMV's first version built its early return's other branch with
the wrong shapes) would otherwise first fail in a device session. Compiling needs no GPU
(Triton ships ptxas), only a fresh process that defines the kernels without the interpreter.
CI compiles with the Triton it installs; to compile with the GPU image's (3.6.0), install that
wheel into a folder of its own and put it first on the path (the compile subprocesses inherit it):
`pip install --no-deps --target /tmp/t36 triton==3.6.0` then
`PYTHONPATH=/tmp/t36 python -m pytest tests/test_kernels_sm90_compile.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Compiles a kernel for sm_90 (no GPU needed) and returns it or its PTX; each script below starts with it.
_PTX = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def ptx(fn, consts, types, num_warps, num_stages):
    return compile_sm90(fn, consts, types, num_warps, num_stages).asm["ptx"]

def compile_sm90(fn, consts, types, num_warps, num_stages):
    # Compile-time flags not given take their defaults, as at a launch that leaves them out.
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # Multiples of 16, as Triton's launcher specializes them at the Llama shapes: pointers,
    # strides, and the GEMVs' N and K (without K's, no load of a weight tile is known to be
    # aligned, and nothing is pipelined).
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "n_cols")}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)
"""

_SCRIPT = _PTX + """
from kiln.kernels.triton_fp8 import _fp8_gemv_dot_kernel, _rms_norm_quant_kernel
from kiln.kernels.triton_norm import _rms_norm_kernel
from kiln.kernels.triton_paged_decode_fp8 import _paged_decode_fp8_kernel

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
             "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "scale": "fp32",
             "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "slot_ptr": "*i64", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
             "qw_ptr": "*bf16", "kw_ptr": "*bf16", "eps": "fp32"}
    for combine, rope, norm in ((False, False, False), (True, False, False), (False, True, False), (False, True, True)):
        consts = dict(KV_SCALE=e4m3, GROUP=4, COLS=8, BLOCK_N=128, HEAD_DIM=128, CACHE_BLOCK=16, NUM_SPLITS=4,
                      WIDEN_ASM=e4m3, SINGLE_TOKENS_ONLY=False, HEADS_FASTEST=True, E4M3=e4m3, COMBINE=combine,
                      NEW_KV=rope, ROPE=rope, HAS_NORM=norm, NO_CONTRACT=rope, ONE_WRITER=rope, PDL=True)
        code = ptx(_paged_decode_fp8_kernel, consts, types, 4, 1)
        body = code[code.index(".entry"):]
        name = f"decode e4m3={e4m3}" + ((" rope norm" if norm else " rope") if rope else f" combine={combine}")
        found[name] = sorted(set(re.findall(r"atom\\.[.\\w]*", code)))
        found[name + " counts"] = [body.count("mul.rn.f32"), len(re.findall(r"fma\\.rn\\.bf16", body)),
                                   body.count(".local")]
# KILN_NORM_EARLY_WEIGHT: the RMSNorm kernels' global loads before the PDL wait (a Llama row).
norm_types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
              "sum_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
for fn, consts in ((_rms_norm_kernel, {}), (_rms_norm_quant_kernel, dict(FP8_MAX_C=448.0, MIN_SCALE_C=1e-12))):
    for early in (False, True):
        code = ptx(fn, dict(consts, HAS_RESIDUAL=True, BLOCK=4096, PDL=True, EARLY_WEIGHT=early), norm_types, 8, 1)
        body = code[code.index(".entry"):]
        found[f"{fn.__name__} early={early}"] = [len(re.findall(r"ld\\.global", body[:body.index("griddepcontrol.wait")])),
                                                 len(re.findall(r"ld\\.global", body))]
# KILN_PDL_EARLY_TRIGGER: PDL == 2 lets the next kernel launch before the wait, True after it.
for pdl in (True, 2):
    code = ptx(_rms_norm_kernel, dict(HAS_RESIDUAL=False, BLOCK=4096, PDL=pdl, EARLY_WEIGHT=True), norm_types, 8, 1)
    found[f"pdl={pdl} order"] = sorted(("wait", "launch"), key=lambda op: code.index(
        "griddepcontrol." + ("wait" if op == "wait" else "launch_dependents")))
print(json.dumps(found))
"""


def test_untimed_kernel_variants_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences Triton's warning; the kernels do not depend on it)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    # GemvConfig.swap_ab: the weight tile as a warpgroup MMA's 64 rows, x's rows as its 16
    # columns, both e4m3 as loaded (a 128-column tile: two such MMAs a K step).
    for variant in ("gemv swap 64 split 1", "gemv swap 128 split 2"):
        assert found[variant] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"], (variant, found[variant])
    # KILN_NORM_EARLY_WEIGHT: only the norm weight's loads (two 16-byte vectors a thread) move
    # before the PDL wait; without it nothing is loaded before the wait.
    for name in ("_rms_norm_kernel", "_rms_norm_quant_kernel"):
        late, early = found[f"{name} early=False"], found[f"{name} early=True"]
        assert late[0] == 0 and early[0] == 2 and early[1] == late[1] == 6, (name, late, early)
    # KILN_PDL_EARLY_TRIGGER: the trigger before the wait, and only with it.
    assert found["pdl=True order"] == ["wait", "launch"] and found["pdl=2 order"] == ["launch", "wait"], found
    # KILN_ATTENTION_FUSED_COMBINE: one atomic a program (its arrival), none without it.
    for e4m3 in (True, False):
        assert found[f"decode e4m3={e4m3} combine=False"] == [], found
        assert len(found[f"decode e4m3={e4m3} combine=True"]) == 1, found
    # KILN_ATTENTION_FUSED_ROPE: RoPE's products by `mul.rn.f32` (the query's and the key's:
    # 18 a thread over a 16-bit cache, 50 with the e4m3 query's three tiles; with the q/k
    # norms' squares and products, KILN_ATTENTION_FUSED_ROPE_NORMS, 63 and 175), never fused
    # into an FMA that skips their rounding to bf16; no spills to local memory either way.
    for e4m3, products, with_norms in ((True, 50, 175), (False, 18, 63)):
        assert found[f"decode e4m3={e4m3} rope counts"] == [products, 0, 0], found
        assert found[f"decode e4m3={e4m3} rope norm counts"] == [with_norms, 0, 0], found
        assert found[f"decode e4m3={e4m3} combine=False counts"] == [0, 0, 0], found


_MOE_SCRIPT = _PTX + """
from kiln.kernels.triton_moe import (_dequantize_rows_kernel, _group_pairs_kernel, _moe_down_kernel,
                                    _moe_down_tma_kernel, _moe_gate_up_kernel, _moe_gate_up_tma_kernel)

found = {}
tiles = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, IEEE=False, PDL=True, SCALED=False)
gu = ptx(_moe_gate_up_tma_kernel, tiles, {"x_desc": "tensordesc<bf16[128,64]>", "w_desc": "tensordesc<bf16[128,64]>",
                                          "out_ptr": "*bf16", "block_expert_ptr": "*i32"}, 8, 3)
down = ptx(_moe_down_tma_kernel, tiles, {"a_desc": "tensordesc<bf16[128,64]>", "a_ptr": "*bf16",
                                         "w_desc": "tensordesc<bf16[128,64]>", "weight_ptr": "*fp32", "out_ptr": "*fp32",
                                         "pairs_ptr": "*i32", "block_expert_ptr": "*i32"}, 8, 3)
# W8A8 (KILN_MOE_FP8_ACTIVATIONS_MIN_ROWS): e4m3 rows and experts through the same descriptors,
# on K tiles of 128 (W8A8_BLOCK_K: the bytes of the 16-bit tiles').
e4m3 = "tensordesc<fp8e4nv[128,128]>"
scales = {"a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32"}
tiles8 = dict(tiles, BLOCK_K=128, SCALED=True)
gu8a = ptx(_moe_gate_up_tma_kernel, tiles8,
           dict(scales, x_desc=e4m3, w_desc=e4m3, out_ptr="*bf16", block_expert_ptr="*i32"), 8, 3)
down8a = ptx(_moe_down_tma_kernel, tiles8,
             dict(scales, a_desc=e4m3, a_ptr="*bf16", w_desc=e4m3, weight_ptr="*fp32", out_ptr="*fp32",
                  pairs_ptr="*i32", block_expert_ptr="*i32"), 8, 3)
for name, code in (("gate_up", gu), ("down", down), ("gate_up w8a8", gu8a), ("down w8a8", down8a)):
    found[name] = [sorted(set(re.findall(r"wgmma\\.mma_async[.\\w]*", code))),
                   sorted(set(re.findall(r"cp\\.async\\.bulk\\.tensor[.\\w]*", code)))]
grp = ptx(_group_pairs_kernel, dict(BLOCK_M=128, E_P2=8, CHUNK=1024, PDL=True),
          {"experts_ptr": "*i64", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32"}, 4, 1)
found["grouping"] = len(grp) > 0
# FP8 experts (kiln::fused_moe_fp8): e4m3 weight tiles widened to bf16 for bf16 warpgroup MMAs.
fp8 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=0, EVEN_K=True, IEEE=False, PAIR_PER_BLOCK=False, W_FP8=True,
           PDL=True)
fp8_types = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "pairs_ptr": "*i32", "block_expert_ptr": "*i32"}
gu8 = ptx(_moe_gate_up_kernel, dict(fp8, TOP_K=2), dict(fp8_types, x_ptr="*bf16", out_ptr="*bf16"), 8, 4)
dn8 = ptx(_moe_down_kernel, fp8, dict(fp8_types, a_ptr="*bf16", weight_ptr="*fp32", out_ptr="*fp32"), 8, 4)
# The default (16-bit) launch of the same kernels, as the GPU runs it: W_FP8 off, the scale
# pointer a tensor never read.
gu16 = ptx(_moe_gate_up_kernel, dict(fp8, TOP_K=2, W_FP8=False),
           dict(fp8_types, x_ptr="*bf16", w_ptr="*bf16", w_scale_ptr="*bf16", out_ptr="*bf16"), 8, 4)
found["gate_up bf16"] = [sorted(set(re.findall(r"wgmma\\.mma_async[.\\w]*", gu16))), "e4m3" in gu16]
for name, code in (("gate_up fp8", gu8), ("down fp8", dn8)):
    found[name] = [sorted(set(re.findall(r"wgmma\\.mma_async[.\\w]*", code))),
                   sorted(set(re.findall(r"cvt\\.[.\\w]*e4m3[.\\w]*", code)))]
# FP8 experts in prefill-sized steps: widened once, by this kernel, for the 16-bit kernels.
deq = ptx(_dequantize_rows_kernel, dict(BLOCK=4096), {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16"}, 4, 1)
found["dequantize"] = [sorted(set(re.findall(r"cvt\\.[.\\w]*e4m3[.\\w]*", deq))),
                       sorted(set(re.findall(r"cvt\\.rn\\.bf16[.\\w]*", deq)))]
# W8A8's input: each sorted row's token quantized where it lands (the gathering form of the
# per-token quantization kernel, TOP_K > 0), stored as e4m3.
from kiln.kernels.triton_fp8 import _quantize_rows_kernel
for top_k in (0, 2):  # (0: the per-token op's own launch, whose kernel this is)
    gq = ptx(_quantize_rows_kernel, dict(FP8_MAX_C=448.0, MIN_SCALE_C=1e-12, BLOCK_K=1024, PDL=True, TOP_K=top_k),
             {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "pairs_ptr": "*i32"}, 4, 1)
    found[f"quantize top_k={top_k}"] = sorted(set(re.findall(r"cvt\\.rn\\.satfinite\\.e4m3x2[.\\w]*", gq)))
print(json.dumps(found))
"""


def test_moe_sorted_rows_and_grouping_kernels_compile_for_sm90() -> None:
    """fused_moe's sorted-rows kernels (timed on the H200 in AC1-AC3, then refactored: their
    shared prologue, `_sorted_block`) load both operands by TMA (`cp.async.bulk.tensor`) and
    multiply on warpgroup MMAs; the one-program grouping (AC5) compiles too, and the pointer
    kernels over FP8 experts (run on the H200 since: AD2) widen e4m3 tiles for bf16 MMAs, and the
    experts' one-pass widening for prefill-sized steps (not yet run on a GPU) converts e4m3 to bf16."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _MOE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for kernel in ("gate_up", "down"):
        mma, tma = found[kernel]
        assert mma == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"], (kernel, mma)
        assert tma and all(op.startswith("cp.async.bulk.tensor.2d") for op in tma), (kernel, tma)
    # W8A8: e4m3 x e4m3 warpgroup MMAs (K 32 a step), both operands by TMA.
    for kernel in ("gate_up w8a8", "down w8a8"):
        mma, tma = found[kernel]
        assert mma == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"], (kernel, mma)
        assert tma and all(op.startswith("cp.async.bulk.tensor.2d") for op in tma), (kernel, tma)
    assert found["grouping"]
    assert found["quantize top_k=0"] and found["quantize top_k=2"], found  # e4m3 conversions, gathered or not
    assert found["gate_up bf16"] == [["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"], False], found
    # FP8 experts: the e4m3 tiles widen in registers (cvt from e4m3x2), the MMAs stay bf16 ones.
    for kernel in ("gate_up fp8", "down fp8"):
        mma, cvt = found[kernel]
        assert mma and all(".bf16.bf16" in op for op in mma), (kernel, mma)
        assert cvt, (kernel, "no e4m3 conversion")
    # The experts' widening for prefill-sized steps: from e4m3, rounded to nearest into bf16.
    widen, to_bf16 = found["dequantize"]
    assert widen and to_bf16, found["dequantize"]


_LATENT_SCRIPT = _PTX + """
from kiln.kernels.triton_paged_attention import LATENT_TILING, _paged_attention_kernel

fn = _paged_attention_kernel
found = {}
for splits in (1, 4):
    consts = dict(SOFTCAP=False, ALIBI=False, KV_SCALE=False, GROUP=16, GROUP_PAD=16, BLOCK_T=1, BLOCK_M=16,
                  BLOCK_N=LATENT_TILING.block_n, HEAD_DIM=576, D_PAD=1024, SEQ_CHUNK=16, CACHE_BLOCK=16,
                  NUM_SPLITS=splits, FP8_CACHE=False, WIDEN_ASM=False, V_TRANS=False,
                  MASK_ALL_BLOCKS=LATENT_TILING.mask_all_blocks, PDL=True, V_IS_K=True)
    types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    types.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                 query_start_loc_ptr="*i32", kv_scale_ptr="*fp32", sinks_ptr="*fp32", alibi_slopes_ptr="*fp32",
                 scale="fp32", softcap="fp32")
    compiled = compile_sm90(fn, consts, types, LATENT_TILING.num_warps, LATENT_TILING.num_stages)
    found[f"splits {splits}"] = [compiled.metadata.shared, "mma" in compiled.asm["ptx"]]
print(json.dumps(found))
"""


def test_latent_attention_tiling_compiles_for_sm90() -> None:
    """Multi-head latent attention over its latent (576 values a token, 16 query heads a KV
    head: DeepSeek-V2-Lite's shape) compiles in the general attention kernel with its own
    tiling (`LATENT_TILING`), within the H100/H200's 227 KB of shared memory a block, on
    tensor-core MMAs; not yet run on a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _LATENT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (shared, mma) in found.items():
        assert 0 < shared <= 227 * 1024 and mma, (name, shared, mma)


# `spills(compiled)`: the bytes of register spill stores ptxas -v reports for a compiled kernel (PTX
# itself has no register allocation; -1: ptxas said nothing of spills).
_SPILLS = _PTX + """
import os, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas

def spills(compiled):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(compiled.asm["ptx"])
        proc = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    stores = re.findall(r"(\\d+) bytes spill stores", proc.stdout + proc.stderr)
    return sum(int(n) for n in stores) if stores else -1
"""

_LATENT_KERNEL_SCRIPT = _SPILLS + """
from kiln.kernels.triton_paged_latent import (LATENT_DECODE, LATENT_DECODE_FP8, LATENT_PREFILL, LATENT_PREFILL_FP8,
                                              _paged_latent_attention_kernel)

fn = _paged_latent_attention_kernel
found = {}
for name, tiling, splits, fp8 in (("decode", LATENT_DECODE, 4, False), ("decode fp8", LATENT_DECODE_FP8, 1, True),
                                  ("prefill", LATENT_PREFILL, 1, False), ("prefill fp8", LATENT_PREFILL_FP8, 1, True)):
    block_t = tiling.tile_rows // tiling.heads
    consts = dict(KV_SCALE=fp8, FP8_CACHE=fp8, GROUP=16, HEADS=tiling.heads, HEAD_BLOCKS=1, BLOCK_T=block_t,
                  BLOCK_M=tiling.tile_rows, BLOCK_N=tiling.block_n, D_MAIN=512, D_TAIL=64, SEQ_CHUNK=64,
                  CACHE_BLOCK=16, NUM_SPLITS=splits, PDL=True)
    types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    types.update(cache_ptr="*fp8e4nv" if fp8 else "*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
                 block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", kv_scale_ptr="*fp32",
                 scale="fp32")
    compiled = compile_sm90(fn, consts, types, tiling.num_warps, tiling.num_stages)
    code = compiled.asm["ptx"]
    found[name] = [compiled.metadata.shared, "mma" in code, spills(compiled)]
print(json.dumps(found))
"""


def test_latent_kernel_compiles_for_sm90() -> None:
    """The latent kernel (`kiln.kernels.triton_paged_latent`: 512 + 64 columns, 16 heads a
    program) at its decode and prefill launch shapes, split, over an FP8 cache: within 227 KB
    of shared memory a block, on tensor-core MMAs, and the bf16 decode without register spills
    (ptxas -v). Three tilings, the fastest in their H100 sweeps (AN3, AN6, AO2; the first two
    18-28% faster than any there that does not spill), spill a little and may, no more than they
    did: the prefill's 64 bytes under Triton 3.6 and 496 under 3.9 (up to 512 here), the FP8
    cache's prefill's 404 and 396 (the e4m3 widening's registers; up to 512), its decode's 4 and
    68 (up to 128; a wider tile or more stages would spill kilobytes)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _LATENT_KERNEL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (shared, mma, spills) in found.items():
        spill_limit = {"prefill": 512, "prefill fp8": 512, "decode fp8": 128}.get(name, 0)
        assert 0 < shared <= 227 * 1024 and mma and 0 <= spills <= spill_limit, (name, shared, mma, spills)


_RECURRENT_DECODE_SCRIPT = _SPILLS + """
from kiln.kernels.triton_causal_conv import BLOCK_C, _conv_single_tokens_kernel
from kiln.kernels.triton_gated_delta_net import BLOCK_V, _gated_delta_decode_kernel
from kiln.kernels.triton_mamba import BLOCK_D, _selective_scan_kernel
from kiln.kernels.triton_mamba2 import BLOCK_P, _mamba2_decode_kernel

found = {}
fn = _gated_delta_decode_kernel
types = {n: "*fp32" for n in fn.arg_names if n.endswith("_ptr")}
types.update(slots_ptr="*i32", continuing_ptr="*i1", conv_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", q_scale="fp32",
             beta_scale="fp32")
# Qwen3-Next's layer: 16 key heads of 128, 32 value heads of 128.
found["gated delta"] = spills(compile_sm90(fn, dict(NUM_K_HEADS=16, V_PER_K=2, HEAD_K=128, HEAD_V=128, K_PAD=128,
                                                    BLOCK_V=BLOCK_V), types, 4, 1))
fn = _conv_single_tokens_kernel
types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
types.update(slots_ptr="*i32", continuing_ptr="*i1")
found["conv"] = spills(compile_sm90(fn, dict(WIDTH=4, W_PAD=4, BLOCK_C=BLOCK_C, HAS_BIAS=True, SILU=True), types, 4, 1))
fn = _mamba2_decode_kernel
types = {n: "*fp32" for n in fn.arg_names if n.endswith("_ptr")}
types.update(slots_ptr="*i32", continuing_ptr="*i1", conv_ptr="*bf16", dt_ptr="*bf16", d_ptr="*bf16", dt_min="fp32")
# Nemotron-H-56B's layer: 128 heads of 64 in 8 groups, a 128-wide state.
found["mamba2"] = spills(compile_sm90(fn, dict(NUM_HEADS=128, N_GROUPS=8, HEAD_DIM=64, STATE=128, STATE_PAD=128,
                                               BLOCK_P=BLOCK_P), types, 4, 1))
fn = _selective_scan_kernel
types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
types.update(a_log_ptr="*fp32", state_ptr="*fp32", slots_ptr="*i32", seq_lens_ptr="*i32", starts_ptr="*i32")
# Falcon-Mamba-7B's layer: 8,192 channels over a 16-wide state.
found["selective scan"] = spills(compile_sm90(fn, dict(STATE=16, STATE_PAD=16, BLOCK_D=BLOCK_D), types, 1, 1))
print(json.dumps(found))
"""


def test_recurrent_decode_kernels_compile_for_sm90() -> None:
    """The gated DeltaNet and Mamba2 decode kernels at Qwen3-Next's and Nemotron-H's head sizes
    ([128, 32] and [16, 128] float32 state tiles a program), the decode convolution and Mamba's
    selective scan (any step) compile for sm_90 without register spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _RECURRENT_DECODE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"gated delta": 0, "conv": 0, "mamba2": 0,
                                                                  "selective scan": 0}


_MOE_ROW_SCRIPT = _SPILLS + """
from kiln.kernels.triton_moe import _moe_down_row_kernel, _moe_gate_up_row_kernel, row_tiling

found = {}
# Qwen3-Next-80B (e4m3 experts, 10 pairs) and Qwen3-30B-A3B (bf16, 8 pairs) at batch 1.
for name, weight, elem, (inter, hidden, pairs) in (("e4m3", "*fp8e4nv", 1, (512, 2048, 10)),
                                                   ("bf16", "*bf16", 2, (768, 2048, 8))):
    for fn, (n, k, halves) in ((_moe_gate_up_row_kernel, (inter, hidden, 2)), (_moe_down_row_kernel, (hidden, inter, 1))):
        tiling = row_tiling(pairs, n, k, elem, halves)
        types = {p: "*bf16" for p in fn.arg_names if p.endswith("_ptr")}
        types.update(w_ptr=weight, experts_ptr="*i64", w_scale_ptr="*fp32", weight_ptr="*fp32",
                     alpha="fp32", limit="fp32")
        if fn is _moe_down_row_kernel:
            types["out_ptr"] = "*fp32"
        consts = dict(BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, EVEN_K=True, W_FP8=elem == 1, PDL=True)
        if fn is _moe_gate_up_row_kernel:
            consts["TOP_K"] = 10
        compiled = compile_sm90(fn, consts, types, tiling.num_warps, tiling.num_stages)
        body = compiled.asm["ptx"]
        found[f"{fn.__name__} {name}"] = [spills(compiled), len(re.findall(r"ld\\.global(?:\\.\\w+)*\\.v4", body))]
# The router kernel at Qwen3-Next-80B's (512 experts, top-10) and Qwen3-30B-A3B's (128, top-8).
from kiln.kernels.triton_moe_router import _softmax_topk_kernel as router
for experts, top_k, warps in ((512, 10, 8), (128, 8, 4)):
    types = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64"}
    compiled = compile_sm90(router, dict(TOP_K=top_k, K_PAD=16 if top_k > 8 else 8, E_PAD=experts, RENORMALIZE=True,
                                         PDL=True), types, warps, 1)
    found[f"router {experts}"] = [spills(compiled), 1]
print(json.dumps(found))
"""


def test_moe_row_kernels_compile_for_sm90() -> None:
    """The per-pair MoE GEMV kernels at Qwen3-Next-80B's (e4m3) and Qwen3-30B-A3B's (bf16)
    batch-1 tilings compile for sm_90 without register spills, loading their weight slices in
    128-bit vectors; the softmax top-k router kernel at both expert counts without spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _MOE_ROW_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 6
    for name, (spilled, vector_loads) in found.items():
        assert spilled == 0 and vector_loads > 0, (name, spilled, vector_loads)
