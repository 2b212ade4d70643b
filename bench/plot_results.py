"""Draw the README's benchmark chart from the JSON that bench/latency.py and
bench/throughput.py wrote into bench/results/, or a serving run's rate-vs-latency curves.

    python3 bench/plot_results.py [--out bench/results/summary.png] [FILES...]
    python3 bench/plot_results.py --serve SERVE.json [SERVE-FP8.json ...] --out serve.png

Without FILES it takes, of each kind, the newest run (by the date inside the file) that
measured the most batch sizes. Needs matplotlib (`pip install matplotlib`, or the `bench`
extra). Prints the figures it drew as JSON, so the README's numbers can be checked against
the picture.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def load(paths: list[Path]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The run to draw per benchmark kind ('latency', 'throughput')."""
    best: dict[str, tuple[tuple[Any, ...], Path, dict[str, Any]]] = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        kind = data.get("benchmark") if isinstance(data, dict) else None
        if kind not in ("latency", "throughput") or "kiln" not in data or "baseline" not in data:
            continue
        width = len(data["kiln"]) if kind == "latency" else 1
        rank = (width, data.get("env", {}).get("date", ""))
        if kind not in best or rank > best[kind][0]:
            best[kind] = (rank, path, data)
    return {kind: (path, data) for kind, (_, path, data) in best.items()}


def figures(runs: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "latency" in runs:
        path, data = runs["latency"]
        sizes = sorted(data["kiln"], key=int)
        out["decode"] = {
            "file": path.name, "date": data["env"].get("date"),
            "batch_sizes": [int(b) for b in sizes],
            "kiln_tokens_per_s": [round(data["kiln"][b]["tokens_per_s"], 1) for b in sizes],
            "hf_tokens_per_s": [round(data["baseline"]["runs"][b]["tokens_per_s"], 1)
                                if b in data["baseline"].get("runs", {}) else None for b in sizes],
        }
    if "throughput" in runs:
        path, data = runs["throughput"]
        out["throughput"] = {
            "file": path.name, "date": data["env"].get("date"), "requests": data["kiln"]["requests"],
            "kiln_output_tokens_per_s": round(data["kiln"]["output_tokens_per_s"], 1),
            "hf_output_tokens_per_s": round(data["baseline"]["output_tokens_per_s"], 1),
        }
    return out


def draw(figs: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    panels = [k for k in ("decode", "throughput") if k in figs]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    kiln_color, hf_color = "#c8553d", "#7a7a7a"
    for ax, kind in zip(axes[0], panels):
        f = figs[kind]
        if kind == "decode":
            xs = range(len(f["batch_sizes"]))
            w = 0.38
            ax.bar([x - w / 2 for x in xs], f["kiln_tokens_per_s"], w, label="Kiln", color=kiln_color)
            ax.bar([x + w / 2 for x in xs], [v or 0 for v in f["hf_tokens_per_s"]], w, label="HF transformers (eager)",
                   color=hf_color)
            for x, v in zip(xs, f["kiln_tokens_per_s"]):
                ax.annotate(f"{v:,.0f}", (x - w / 2, v), ha="center", va="bottom", fontsize=8)
            ax.set_xticks(list(xs), [str(b) for b in f["batch_sizes"]])
            ax.set_yscale("log")
            ax.set_xlabel("batch size (sequences decoding together)")
            ax.set_ylabel("output tokens/s (log scale)")
            ax.set_title("Decode throughput")
            ax.legend(fontsize=8, loc="upper left")
        else:
            vals = [f["kiln_output_tokens_per_s"], f["hf_output_tokens_per_s"]]
            ax.bar(["Kiln", "HF transformers\n(eager)"], vals, color=[kiln_color, hf_color])
            for x, v in enumerate(vals):
                ax.annotate(f"{v:,.0f}", (x, v), ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("output tokens/s")
            ax.set_title(f"Offline throughput ({f['requests']:,} requests)")
    fig.suptitle("Llama-3-8B shape, bf16, one NVIDIA H200", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def serve_curves(paths: list[Path]) -> dict[str, Any]:
    """Per bench/serve.py run (one curve each: e.g. bf16 and FP8): the QPS / P99 table rows,
    finite offered rates only on the x axis of the first panel ('inf' is marked apart)."""
    curves: dict[str, Any] = {}
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("benchmark") != "serve":
            raise SystemExit(f"plot_results: {path} is not a bench/serve.py result")
        options = data.get("config", {}).get("engine_options", {})
        label = ", ".join(f"{k}={v}" for k, v in options.items() if k in ("quantization", "kv_cache_dtype")) \
            or path.stem
        curves[label] = {"file": path.name, "date": data.get("environment", {}).get("date"),
                         "rows": data.get("table") or [], "complete": data.get("complete", True)}
    return curves


def draw_serve(curves: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, curve in curves.items():
        rows = [r for r in curve["rows"] if r["requests_per_s"] > 0]
        achieved = [r["requests_per_s"] for r in rows]
        offered = [r["rate"] if r["rate"] != "inf" else None for r in rows]
        line = axes[0].plot([o for o in offered if o is not None],
                            [a for o, a in zip(offered, achieved) if o is not None], marker="o", label=label)[0]
        saturated = [a for o, a in zip(offered, achieved) if o is None]
        if saturated:
            axes[0].axhline(saturated[0], color=line.get_color(), linestyle=":", linewidth=1,
                            label=f"{label}: all at once")
        for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
            for q, style in (("p50", "-"), ("p99", "--")):
                ax.plot(achieved, [r[f"{key}_{q}_ms"] for r in rows], style, marker="o", color=line.get_color(),
                        label=f"{label} {q.upper()}")
    axes[0].set_xlabel("offered rate (requests/s)")
    axes[0].set_ylabel("achieved requests/s")
    axes[0].set_title("Throughput")
    axes[1].set_title("Time to first token")
    axes[2].set_title("Time per output token")
    for ax in axes[1:]:
        ax.set_xlabel("achieved requests/s")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("kiln serve: Poisson arrivals, rate vs latency (bench/serve.py)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="result JSON files (default: bench/results/*.json)")
    p.add_argument("--out", type=Path, default=RESULTS / "summary.png", help="PNG to write")
    p.add_argument("--serve", action="store_true", help="FILES are bench/serve.py results: draw rate vs latency")
    args = p.parse_args(argv)
    if args.serve:
        if not args.files:
            p.error("--serve needs the bench/serve.py result files")
        return _draw_and_print(draw_serve, serve_curves(args.files), args.out)
    runs = load(args.files or sorted(RESULTS.glob("*.json")))
    if not runs:
        print("plot_results: no latency or throughput results found", file=sys.stderr)
        return 1
    return _draw_and_print(draw, figures(runs), args.out)


def _draw_and_print(draw_fn: Any, data: Any, out: Path) -> int:
    """Draw `data` into `out` with `draw_fn` and print it as JSON; 1 without matplotlib."""
    try:
        draw_fn(data, out)
    except ImportError:
        print("plot_results: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
