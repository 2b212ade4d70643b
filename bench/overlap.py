"""Does a big decode step gain from two nano-batches on two CUDA streams? (issue 16, "overlap")

A decode step of ~1,000 sequences (the offline workload's) is two kinds of work per layer:
GEMMs that are compute-bound at that many rows and paged attention that is bound by reading
the KV cache. In one stream they run one after the other. Split the batch in two halves and
run each half's layers on its own stream: while one half's attention streams KV, the other
half's GEMMs can use the tensor cores. This measures whether the GPU actually overlaps them,
before the engine is changed to do it: `--layers` decoder layers of the Llama-3-8B shape
(QKV, paged attention over contexts like the workload's, O, gate/up, SiLU-and-mul, down; no
norms), timed three ways (CUDA events, median of `--repeats`):

  whole      - all `--seqs` sequences, one stream (what a step does today);
  halves     - two halves one after the other on one stream (the cost of splitting alone);
  two_streams - the two halves on two streams, launched op by op in turn.

`overlap_gain` = whole / two_streams: above 1 the split pays. Each half has its own KV
cache blocks and query rows; within a half each op reads the previous one's output.

In J1 (bench/RESULTS.md) two streams gained nothing: each GEMM's persistent grid takes every
SM, so the other half's attention could only run where a GEMM had finished. `--carveouts`
repeats two_streams (and the GEMMs alone) with cuBLASLt told to leave N SMs free
(`torch._C._set_sm_carveout_experimental`, the matmuls routed through cuBLASLt), so that
attention programs can run beside every GEMM: whether partitioning the SMs makes the overlap
real, and what it costs the GEMMs.

    python bench/overlap.py --out overlap.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

import bench_common as bc
from tune_attention import D, HQ, make_step

HIDDEN, QKV, INTER = 4096, 6144, 14336


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=1000, help="sequences in the decode step")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--carveouts", default="16,32,48",
                        help="SMs the GEMMs leave free in extra two-stream runs (comma list; empty: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("overlap.py times CUDA streams; no CUDA device is available")
    if args.seqs < 2:
        parser.error("--seqs: at least 2 (two halves)")
    from kiln.kernels.triton_paged_attention import attend_paged_triton

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    dev_gen = torch.Generator(device=device).manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn((n, k), device=device, dtype=torch.bfloat16, generator=dev_gen) * 0.02

    w_qkv, w_o = weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN)
    w_gate_up, w_down = weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)
    ctx = torch.randint(128 + 256, 1024 + 256 + 1, (args.seqs,), generator=gen).tolist()  # prompt + ~half the output
    half = args.seqs // 2
    steps = {"whole": make_step(ctx, [], device, gen), "a": make_step(ctx[:half], [], device, gen),
             "b": make_step(ctx[half:], [], device, gen)}
    xs = {k: torch.randn((s["q"].shape[0], HIDDEN), device=device, dtype=torch.bfloat16, generator=dev_gen)
          for k, s in steps.items()}

    def layer_ops(key: str) -> list[Any]:
        """One layer of the half (or whole) batch `key`, as a list of calls to run in order."""
        step = steps[key]
        state: dict[str, torch.Tensor] = {"x": xs[key]}

        def qkv() -> None:
            state["qkv"] = state["x"] @ w_qkv.T

        def attention() -> None:
            q = state["qkv"][:, :HQ * D].reshape(-1, HQ, D)
            state["attn"] = attend_paged_triton(q, step["kv_cache"], step["block_tables"], step["seq_lens"],
                                                step["query_start_loc"], D ** -0.5, 0).reshape(-1, HQ * D)

        def o_proj() -> None:
            state["h"] = state["attn"] @ w_o.T

        def mlp() -> None:
            gate_up = state["h"] @ w_gate_up.T
            state["x"] = (F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]) @ w_down.T

        return [qkv, attention, o_proj, mlp]

    def run_whole() -> None:
        for _ in range(args.layers):
            for op in layer_ops("whole"):
                op()

    def run_halves() -> None:
        for key in ("a", "b"):
            for _ in range(args.layers):
                for op in layer_ops(key):
                    op()

    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def run_two_streams() -> None:
        main_stream = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(main_stream)
        ops = {key: [op for _ in range(args.layers) for op in layer_ops(key)] for key in ("a", "b")}
        # Half b starts one op behind half a, so a's attention meets b's QKV GEMM, and so on.
        with torch.cuda.stream(streams[0]):
            ops["a"][0]()
        for i in range(1, len(ops["a"]) + 1):
            if i < len(ops["a"]):
                with torch.cuda.stream(streams[0]):
                    ops["a"][i]()
            with torch.cuda.stream(streams[1]):
                ops["b"][i - 1]()
        for s in streams:
            main_stream.wait_stream(s)

    result: dict[str, Any] = {"benchmark": "overlap", "env": bc.environment(), "seqs": args.seqs,
                              "layers": args.layers, "mean_context": sum(ctx) / len(ctx)}
    for name, fn in (("whole", run_whole), ("halves", run_halves), ("two_streams", run_two_streams)):
        ms = bc.median_cuda_ms(fn, args.repeats)
        result[name] = {"ms": ms, "ms_per_layer": ms / args.layers}
        print(f"[{name}] {ms / args.layers:.3f} ms per layer", flush=True)
    # The parts alone, for the ideal: a perfect overlap would take max(GEMMs, attention).
    qkv, attention, o_proj, mlp = layer_ops("whole")
    qkv()
    attention()  # every state the parts read exists now
    for name, parts in (("attention_only", [attention]), ("gemms_only", [qkv, o_proj, mlp])):
        ms = bc.median_cuda_ms(lambda parts=parts: [op() for _ in range(args.layers) for op in parts], args.repeats)
        result[name] = {"ms": ms, "ms_per_layer": ms / args.layers}
        print(f"[{name}] {ms / args.layers:.3f} ms per layer", flush=True)
    carveouts = [int(n) for n in args.carveouts.split(",") if n.strip()]
    if carveouts and not hasattr(torch._C, "_set_sm_carveout_experimental"):
        print("[carveout] this torch has no SM carveout setting: skipped", flush=True)
        carveouts = []
    for carveout in carveouts:
        previous_backend = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")  # the carveout is a cuBLASLt setting
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            runs = {"two_streams": run_two_streams, "gemms_only": lambda: [op() for _ in range(args.layers)
                                                                           for op in (qkv, o_proj, mlp)]}
            out = {}
            for name, fn in runs.items():
                ms = bc.median_cuda_ms(fn, args.repeats)
                out[name] = {"ms": ms, "ms_per_layer": ms / args.layers}
            out["overlap_gain"] = result["whole"]["ms"] / out["two_streams"]["ms"]
            result[f"carveout_{carveout}"] = out
            print(f"[carveout {carveout} SMs] two streams {out['two_streams']['ms_per_layer']:.3f} ms per layer "
                  f"(whole / two streams = {out['overlap_gain']:.3f}), GEMMs alone "
                  f"{out['gemms_only']['ms_per_layer']:.3f}", flush=True)
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(previous_backend)
    result["ideal_gain"] = (result["attention_only"]["ms"] + result["gemms_only"]["ms"]) / max(
        result["attention_only"]["ms"], result["gemms_only"]["ms"])
    result["overlap_gain"] = result["whole"]["ms"] / result["two_streams"]["ms"]
    result["split_cost"] = result["halves"]["ms"] / result["whole"]["ms"]
    print(f"[overlap] whole / two streams = {result['overlap_gain']:.3f} (a perfect overlap: "
          f"{result['ideal_gain']:.3f}); halves / whole = {result['split_cost']:.3f}", flush=True)
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
