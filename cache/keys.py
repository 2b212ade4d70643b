"""Cache keys: what a compiled artifact depends on, hashed.

A key is the SHA-256 of its *factors*, a JSON-able dict:

- `architecture`: the model config with every field that does not shape the graph removed
  (paths, token ids, dtype, transformers' bookkeeping); weights never enter;
- `dtype`, `block_size` (the KV cache's static block dimension);
- `passes`: each pass's uuid (hash of its source and options);
- `kiln`: the Kiln version plus a hash of the sources that decide what an artifact
  contains (capture and its inline-attention pass, the compile step, the custom ops' schemas and implementations);
- `torch`, `triton` versions; `device` kind and `capability` (CUDA compute capability, or
  the CPU's vector ISA, since the C++ kernels are built for it);
- `format` of the artifact; and, for a bucket, the bucket's static shape.

Entry kinds: `graph` (the model's GraphSpec, shared by every compile mode), `bucket` (one
AOTInductor package per bucket, mode "inductor") and `graphcode` (the post-pass FX graph's
Python source, mode "graph"; its `format` factor is its own, so its key never equals
another kind's even apart from the kind prefix).

No absolute path or hostname enters a key, so a cache compiled in CI is valid anywhere the
factors match. Factors are kept in each entry's manifest so a miss can be explained.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any, Protocol

import torch



class BucketShape(Protocol):
    """What a key needs of a bucket (kiln.compiler.buckets.Bucket): its static shape."""

    def shape(self) -> dict[str, Any]: ...

MODEL_KIND = "graph"
BUCKET_KIND = "bucket"
# No hyphen: the store's keys are `<lowercase kind>-<32 hex>` (kiln.cache.store._KEY_RE).
GRAPH_CODE_KIND = "graphcode"
# CUDA: the binaries of every Triton kernel a model setup's buckets run (kiln.compiler.triton_kernels).
TRITON_KERNELS_KIND = "tritonkernels"
# A config.json's transformers-free snapshot (kiln.compiler.model_source.ConfigSnapshot).
CONFIG_KIND = "config"

# Config fields that never change the computation: where the model came from, tokenizer
# ids, defaults for generation, transformers' own bookkeeping. Fields starting with "_"
# (private state that transformers and capture set on the object) are dropped as well.
NON_ARCHITECTURE_FIELDS = frozenset({
    "name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "tokenizer_class", "prefix", "task_specific_params", "problem_type", "torchscript",
    "finetuning_task", "initializer_range", "chat_template", "output_scores",
    "return_dict_in_generate", "tie_encoder_decoder",
})

# Sources (relative to the kiln package folders) whose changes change what an artifact is.
KEY_SOURCES = (
    ("kiln.compiler", ("capture.py", "pipeline.py", "inductor_compile.py")),
    # Part of capture, though it lives with the passes: it is not a pipeline pass with a uuid.
    ("kiln.passes", ("inline_attention.py",)),
    ("kiln.kernels", ("*.py",)),
)


def architecture_fields(config: Any) -> dict[str, Any]:
    """The config fields that shape the graph, as plain JSON values, sorted by name."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out = {}
    for name in sorted(raw):
        if name.startswith("_") or name in NON_ARCHITECTURE_FIELDS:
            continue
        out[name] = _jsonable(raw[name])
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def kiln_source_version() -> str:
    """`<version>+src.<hash>`: the package version and a hash of the artifact-shaping sources."""
    try:
        version = importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        version = "0+unknown"
    h = hashlib.sha256()
    import importlib as _importlib

    for package, patterns in KEY_SOURCES:
        folder = Path(_importlib.import_module(package).__file__).parent
        for pattern in patterns:
            for path in sorted(folder.glob(pattern)):
                h.update(path.name.encode())
                h.update(path.read_bytes())
    return f"{version}+src.{h.hexdigest()[:12]}"


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def device_capability(device: torch.device) -> str:
    """What compiled code for `device` is specific to: the CUDA compute capability, or on CPU
    the machine architecture and the vector ISA ATen dispatches to (read without compiling
    anything, unlike Inductor's own ISA probe)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability().lower()}"


def model_factors(
    config: Any,
    dtype: torch.dtype,
    pass_uuids: dict[str, str],
    device: torch.device,
    block_size: int,
    artifact_format: str,
    kv_cache_dtype: torch.dtype | None = None,
    quantization: str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> dict[str, Any]:
    """The factors every entry of one model setup shares (the graph spec's key factors).

    `kv_cache_dtype` (when it differs from `dtype`) and `quantization` enter only when set, so
    the keys of unquantized setups are what they were before these options existed.
    Tensor parallelism: each rank's graph differs (its weight shapes, its vocabulary offset),
    so the group size and the rank are factors, and `kiln cache explain` names them."""
    extra: dict[str, Any] = {}
    if kv_cache_dtype is not None and kv_cache_dtype != dtype:
        extra["kv_cache_dtype"] = str(kv_cache_dtype).removeprefix("torch.")
    if quantization is not None:
        extra["quantization"] = quantization
    return {
        **extra,
        "tensor_parallel": {"size": int(tp_size), "rank": int(tp_rank)},
        "architecture": architecture_fields(config),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": int(block_size),
        "passes": dict(sorted(pass_uuids.items())),
        "kiln": kiln_source_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "device": device.type,
        "capability": device_capability(device),
        "format": artifact_format,
    }


def bucket_factors(model: dict[str, Any], bucket: BucketShape) -> dict[str, Any]:
    return {**model, "bucket": bucket.shape()}


def graph_code_factors(model: dict[str, Any], code_format: str) -> dict[str, Any]:
    """A graph-code entry's factors: the model's, with the code's own artifact format."""
    return {**model, "format": code_format}


def config_snapshot_factors(raw_config: dict[str, Any], transformers_version: str) -> dict[str, Any]:
    """A config snapshot's factors: the config.json as read, the transformers version that
    built the config from it (its defaults fill the snapshot) and Kiln's version."""
    return {"raw_config": _jsonable(raw_config), "transformers": transformers_version, "kiln": kiln_source_version()}


def key_for(kind: str, factors: dict[str, Any]) -> str:
    """`<kind>-<32 hex>`: the hash of the canonical JSON of the factors."""
    blob = json.dumps(factors, sort_keys=True, separators=(",", ":")).encode()
    return f"{kind}-{hashlib.sha256(blob).hexdigest()[:32]}"


def flatten_factors(factors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested factors as dotted paths: {"passes": {"a": 1}} -> {"passes.a": 1}."""
    out: dict[str, Any] = {}
    for name, value in factors.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            out.update(flatten_factors(value, path + "."))
        else:
            out[path] = value
    return out


def factor_differences(have: dict[str, Any], want: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted factor, value in `have`, value in `want`) for every factor that differs.

    A factor absent on one side shows as None there.
    """
    a, b = flatten_factors(have), flatten_factors(want)
    return [(name, a.get(name), b.get(name)) for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
