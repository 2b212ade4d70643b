"""The FP8 GEMVs fused with their input's producer (kernels/triton_fp8_fused_linear.py) against
the chains they replace, at the Llama-3-8B decode projections.

A decode layer in FP8 runs, before each projection, a small kernel that makes its input: the
RMSNorm with its e4m3 quantization before QKV and gate/up, SiLU-and-mul with it before
down, the attention output's quantization before O. The fused ops do that inside the GEMV
(weight-only FP8, at one row; elsewhere, and where its table says so, the fused op runs
the chain). This times, inside CUDA graphs (PDL as the engine runs it),
`--layers` layers of the four projections with distinct weights (so each reads its weight
from HBM, as a decode step does): the fused ops, and the chains (the `*_quant_fp8` kernel
then `kiln::fp8_linear`'s GEMV). Also each projection alone, and with `--sweep` a few other
tilings of each fused GEMV. JSON out: microseconds per layer and per projection.

    python bench/fp8_fused_gemv.py --rows 1,8 --out fp8-fused-gemv.json
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

import torch

import bench_common as bc

# name: (N, K, the producer of its input)
PROJECTIONS = {"qkv": (6144, 4096, "add_rms_norm"), "o": (4096, 4096, "plain"),
               "gate_up": (28672, 4096, "add_rms_norm"), "down": (4096, 14336, "silu_and_mul")}
EPS = 1e-5


def layer_calls(m: int, layers: int, fused: bool, names: list[str], configs: dict[str, Any] | None = None
                ) -> list[Callable[[], Any]]:
    from kiln.kernels import triton_fp8_fused_linear as tf
    from kiln.kernels.fp8 import quantize_fp8_rowwise
    from kiln.kernels.fp8_fused_linear import (add_rms_norm_fp8_linear_chain, quantize_fp8_linear_chain,
                                               silu_and_mul_fp8_linear_chain)

    configs = configs or {}
    dev, dt = "cuda", torch.bfloat16
    calls: list[Callable[[], Any]] = []
    for _ in range(layers):
        for name in names:
            n, k, producer = PROJECTIONS[name]
            wq, ws = quantize_fp8_rowwise(torch.randn(n, k, device=dev) * k ** -0.5)
            config = configs.get(name)
            if producer == "add_rms_norm":
                x, r = torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
                g = torch.ones(k, device=dev, dtype=dt)
                if fused:
                    calls.append(lambda x=x, r=r, g=g, wq=wq, ws=ws, c=config:
                                 tf.add_rms_norm_fp8_linear_triton(x, r, g, EPS, wq, ws, None, dt, c))
                else:
                    calls.append(lambda x=x, r=r, g=g, wq=wq, ws=ws:
                                 add_rms_norm_fp8_linear_chain(x, r, g, EPS, wq, ws, None, dt))
            elif producer == "silu_and_mul":
                gate_up = torch.randn(m, 2 * k, device=dev, dtype=dt)
                gate, up = gate_up[:, :k], gate_up[:, k:]
                if fused:
                    calls.append(lambda gate=gate, up=up, wq=wq, ws=ws, c=config:
                                 tf.silu_and_mul_fp8_linear_triton(gate, up, wq, ws, None, dt, c))
                else:
                    calls.append(lambda gate=gate, up=up, wq=wq, ws=ws:
                                 silu_and_mul_fp8_linear_chain(gate, up, wq, ws, None, dt))
            else:
                x = torch.randn(m, k, device=dev, dtype=dt)
                if fused:
                    calls.append(lambda x=x, wq=wq, ws=ws, c=config: tf.quantize_fp8_linear_triton(x, wq, ws, None,
                                                                                                  dt, c))
                else:
                    calls.append(lambda x=x, wq=wq, ws=ws: quantize_fp8_linear_chain(x, wq, ws, None, dt))
    return calls


def time_layers(m: int, layers: int, fused: bool, names: list[str], configs: dict[str, Any] | None = None) -> float:
    """Microseconds per layer (of the projections `names`)."""
    calls = layer_calls(m, layers, fused, names, configs)
    us = bc.graph_time_us(calls) * len(calls) / layers
    del calls
    torch.cuda.empty_cache()
    return us


def _asdict(config: Any) -> dict[str, Any] | None:
    return None if config is None else dataclasses.asdict(config)  # None: the op runs its chain


def alternatives(name: str, m: int) -> list[Any]:
    from kiln.kernels.triton_fp8_fused_linear import fused_gemv_config
    from kiln.kernels.triton_linear import GemvConfig

    n, k, _ = PROJECTIONS[name]
    table = fused_gemv_config(n, k, m)
    if m != 1:
        return []  # the fused kernel runs at one row only
    cands = [GemvConfig(*t) for t in ((4, 1024, 4, 3), (8, 1024, 8, 3), (16, 512, 8, 3), (16, 1024, 8, 3),
                                      (32, 512, 8, 3), (32, 256, 8, 3), (64, 256, 8, 3))]
    return [c for c in cands if k % c.block_k == 0 and c != table]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="also a few other tilings of each fused GEMV")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import kiln.kernels  # noqa: F401  (registers the CUDA kernels)
    from kiln.kernels.triton_fp8_fused_linear import fused_gemv_config

    names = list(PROJECTIONS)
    results: dict[str, Any] = {"layers": args.layers, "rows": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        row: dict[str, Any] = {"layer_us": {"chain": time_layers(m, args.layers, False, names),
                                            "fused": time_layers(m, args.layers, True, names)}}
        row["layer_us"]["gain"] = row["layer_us"]["chain"] / row["layer_us"]["fused"]
        per: dict[str, Any] = {}
        for name in names:
            n, k, _ = PROJECTIONS[name]
            entry = {"chain_us": time_layers(m, args.layers, False, [name]),
                     "fused_us": time_layers(m, args.layers, True, [name]),
                     "config": _asdict(fused_gemv_config(n, k, m))}
            entry["fused_tb_s"] = n * k / entry["fused_us"] / 1e6
            if args.sweep:
                entry["sweep"] = []
                for c in alternatives(name, m):
                    try:
                        us = time_layers(m, args.layers, True, [name], {name: c})
                    except Exception as e:  # a tiling that does not fit this GPU
                        entry["sweep"].append({"config": dataclasses.asdict(c), "error": f"{type(e).__name__}: {e}"[:200]})
                        continue
                    entry["sweep"].append({"config": dataclasses.asdict(c), "us": us})
            per[name] = entry
            print(f"rows {m} {name}: chain {entry['chain_us']:.1f} us, fused {entry['fused_us']:.1f} us", flush=True)
        row["projections"] = per
        results["rows"][str(m)] = row
        print(f"rows {m}: layer chain {row['layer_us']['chain']:.1f} us, fused {row['layer_us']['fused']:.1f} us",
              flush=True)
    results["gpu"] = torch.cuda.get_device_name()
    bc.emit(results, args.out)


if __name__ == "__main__":
    main()
