"""`EngineConfig`: the one definition of the engine's options.

`LLM(model, **options)` takes exactly these fields, and `kiln` commands derive their flags
(name, default, help, choices) from the field metadata here (kiln.runtime.cli.common), so an
option is added in one place. The compiler receives its own `CompileOptions`, built by
`compile_options()`: it never sees the runtime's config.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.startup import COMPILE_MODES, CompileOptions
from kiln.runtime.hardware_defaults import BatchLimits, choose_batch_limits, device_memory_bytes

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
MODEL_HELP = ("Hugging Face hub id (org/name, from the local HF cache or downloaded), directory, .gguf file or "
              "config.json (default: SmolLM2-135M-Instruct GGUF)")


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = "", group: str = "engine",
           choices: tuple[str, ...] | None = None, serving_only: bool = False, default_factory: Any = None,
           short: str | None = None) -> Any:
    """A dataclass field with what the CLI needs: its help, its flag ("" for --field-name,
    None for no flag; a bool field whose default is True gets a flag storing False), a short
    form of the flag (vLLM's `-tp`), its argument group, its choices, and whether only
    commands that run an engine have it (not `kiln compile`)."""
    meta = {"help": help, "flag": flag, "group": group, "choices": choices, "serving_only": serving_only,
            "short": short}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model: str | None = option(None, help=MODEL_HELP, flag=None)
    # Hub ids (kiln.compiler.model_source.resolve_model): which commit, where the HF cache is.
    revision: str | None = option(None, help="hub ids: branch, tag or commit of the model (default: main)")
    download_dir: str | None = option(None, help="hub ids: Hugging Face cache directory to read and download into "
                                                 "(default: $HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    tokenizer: str | None = option(None, help="tokenizer to use instead of the model's (a hub id or a directory)")
    tokenizer_revision: str | None = option(None, help="hub ids: revision of --tokenizer")
    # Accepted for vLLM's scripts. Kiln captures the architectures transformers ships and
    # never runs a repo's own modelling code; a repo that needs it is refused with a message
    # (kiln.compiler.model_source), with or without this option.
    trust_remote_code: bool = option(False, help="accepted for vLLM compatibility; Kiln never runs a model repo's own "
                                                 "code (such models are refused with a message)")
    # No automatic flag: `kiln generate --seed` is the request seed; `kiln serve --seed` sets this one.
    seed: int | None = option(None, flag=None, help="seed of the sampler for requests that set none (the same requests "
                                                     "in the same order give the same text)")
    dtype: str = option("auto", help="float32 | bfloat16 | float16 | auto (float32 on CPU, bfloat16 on CUDA)")
    device: str = option("auto", help="cpu | cuda | auto (CUDA when available)")
    load_format: str = option("auto", choices=("auto", "dummy"),
                              help="'dummy' uses deterministic random weights (benchmarks)")
    # None: chosen at start-up from the model and the hardware (kiln.runtime.hardware_defaults).
    max_model_len: int | None = option(None, help="longest prompt + output, in tokens (default: the model's context "
                                                  "length when one sequence of it fits in the KV cache)")
    max_num_seqs: int | None = option(None, help="most sequences in one step (default: 1024 on a GPU of >= 70 GiB, "
                                                 "256 on smaller GPUs, 64 on CPU)")
    max_num_batched_tokens: int | None = option(None, help="token budget of one step (default: 16384 on a GPU of "
                                                           ">= 70 GiB, 8192 on smaller GPUs, 2048 on CPU)")
    block_size: int = option(16, help="tokens per KV-cache block")
    num_kv_blocks: int | None = option(None, help="KV-cache blocks (default: sized from memory)")
    enable_prefix_caching: bool = option(True, flag="--no-prefix-caching",
                                         help="disable reuse of cached prompt prefixes")
    # Admission keeps KV blocks free for the running sequences' next tokens, so that a full
    # cache rarely preempts (kiln.runtime.scheduler; SGLang's new_token_ratio).
    kv_reserve_ratio: float = option(0.5, help="admit a request only if the KV cache keeps room for this share of "
                                               "the tokens running requests may still generate (all of it for "
                                               "requests only max_tokens can end), learned down as requests "
                                               "finish early; 0: admit whatever fits and preempt when full, as vLLM")
    enable_passes: list[str] = option(default_factory=list, flag="--enable-pass",
                                      help="turn on an optional pass (repeatable)")
    disable_passes: list[str] = option(default_factory=list, flag="--disable-pass", help="turn off a pass (repeatable)")
    # FP8 (issue 16): the quantize_fp8 pass and an e4m3 KV cache. A pre-quantized FP8
    # checkpoint implies quantization="fp8" (LLMEngine).
    quantization: str | None = option(None, choices=QUANTIZATIONS,
                                      help="fp8: projections as FP8 GEMMs (e4m3 weights with per-channel scales, "
                                           "quantized at load unless the checkpoint is FP8 already)")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES,
                                 help="auto: the model's dtype; fp8: e4m3 KV cache (half the bytes of bf16)")
    # An FP8 KV cache's per-layer scales, when the checkpoint ships none: measured at start-up
    # from one prefill of a built-in text (kiln.runtime.kv_scale_calibration), instead of 1.0.
    calculate_kv_scales: bool = option(True, flag="--no-calculate-kv-scales",
                                       help="with --kv-cache-dtype fp8 and a checkpoint without KV scales: keep "
                                            "scale 1.0 instead of calibrating per-layer scales at start-up")
    # Tensor parallelism (issue 14; runtime/README.md, "Tensor parallelism"): one worker
    # process per rank, each running its shard of the graph (kiln.passes.shard_tensor_parallel).
    tensor_parallel_size: int = option(1, short="-tp", help="GPUs (CPU: processes) to shard the model over, one "
                                                            "worker process each")
    distributed_executor_backend: str = option("mp", choices=("mp", "ray"), serving_only=True,
                                               help="how tensor-parallel workers are started: mp (processes on this "
                                                    "host) or ray (Ray actors, one per GPU, across hosts)")
    gpu_memory_utilization: float = option(0.9, help="CUDA: fraction of GPU memory for weights, activations and "
                                                     "the KV cache")
    enforce_eager: bool = option(False, help="CUDA: run every step without capturing CUDA graphs")
    # Mixed steps (prefill chunks beside decodes) of up to this many tokens replay a CUDA graph
    # too (kiln.compiler.buckets, mixed-graph buckets): without one, each runs the post-pass
    # graph op by op, and the host's launches can outlast the device's work. 512 by default:
    # in serving every arriving prompt rides in such a step beside the running decodes
    # (bench/RESULTS.md, AQ1: TPOT P50 20.3 -> 7.5 ms at 16 requests/s on an H100), and the
    # four graphs cost ~0.2 s of a warm start (AR2).
    cuda_graph_mixed_tokens: int = option(512, help="CUDA: capture CUDA graphs for mixed prefill/decode steps of up "
                                                    "to this many tokens (powers of two from 64, capped by "
                                                    "max_num_batched_tokens); 0: none")
    # Launch the next decode step before reading this one's tokens, so the host's per-step
    # work overlaps the device's (LLMEngine.step).
    async_scheduling: bool = option(True, flag="--no-async-scheduling",
                                    help="read every step's tokens back before scheduling the next (default: the "
                                         "next decode step is launched first, overlapping host and device work)")
    progress: bool = option(True, flag=None, help="progress bars while loading weights and compiling")
    # The compile cache (kiln.compiler.startup): see CompileOptions and resolve_compile_mode.
    compile: str = option("auto", group="compile cache", choices=COMPILE_MODES, serving_only=True,
                          help="auto: use the device's cached artifact (CPU: Inductor packages; CUDA: the post-pass "
                               "graph as code) when the cache holds it all, fill misses only with --cache-dir or "
                               "--require-cache, else run eagerly; eager: run the FX graph directly, compiling "
                               "nothing; inductor: compile what is missing; graph: cache the post-pass FX graph")
    cache_dir: str | None = option(None, group="compile cache",
                                   help="compile cache directory (default: $KILN_CACHE_DIR or ~/.cache/kiln)")
    require_cache: bool = option(False, group="compile cache", serving_only=True,
                                 help="fail at start-up, naming the missing buckets, instead of compiling "
                                      "(see `kiln compile`)")
    # Bucket sizes (None: the default plan); the CLI's --buckets sets both.
    decode_buckets: list[int] | None = option(None, flag=None, help="decode batch sizes to compile")
    token_buckets: list[int] | None = option(None, flag=None, help="token counts of prefill/mixed steps to compile")

    def __post_init__(self) -> None:
        if self.model is not None:
            self.model = str(self.model)
        for name in ("cache_dir", "download_dir", "tokenizer"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.enable_passes, self.disable_passes = list(self.enable_passes), list(self.disable_passes)
        if int(self.block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("max_model_len", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1 (or None for the default), got {getattr(self, name)}")
        if (not isinstance(self.cuda_graph_mixed_tokens, int) or isinstance(self.cuda_graph_mixed_tokens, bool)
                or self.cuda_graph_mixed_tokens < 0):
            raise ValueError(f"cuda_graph_mixed_tokens must be an integer >= 0 (0: no mixed-step graphs), "
                             f"got {self.cuda_graph_mixed_tokens!r}")
        if not 0 <= self.kv_reserve_ratio <= 1:
            raise ValueError(f"kv_reserve_ratio must be in [0, 1], got {self.kv_reserve_ratio}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None; got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if (not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool)
                or self.tensor_parallel_size < 1):
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}; got {self.compile!r}")

    @classmethod
    def from_options(cls, model: Any = None, **options: Any) -> "EngineConfig":
        """An EngineConfig from keyword options, refusing unknown names with a suggestion."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in options if k not in names]
        if unknown:
            hints = [f"{k!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, names, 1))
                                 else "") for k in unknown]
            raise TypeError(f"unknown engine option(s) {', '.join(hints)}; options are: {', '.join(names)}")
        return cls(model=model, **options)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} asked for, but CUDA is not available on this machine")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def batch_limits(self, device: torch.device) -> BatchLimits:
        """max_num_seqs and max_num_batched_tokens: as set, or the device's defaults."""
        return choose_batch_limits(self.max_num_seqs, self.max_num_batched_tokens, device.type,
                                   device_memory_bytes(device))

    def with_batch_limits(self, device: torch.device) -> tuple["EngineConfig", BatchLimits]:
        """A copy with both batch limits concrete for `device`, and why they are what they are."""
        limits = self.batch_limits(device)
        return dataclasses.replace(self, max_num_seqs=limits.max_num_seqs,
                                   max_num_batched_tokens=limits.max_num_batched_tokens), limits

    def resolved_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type for a model computing in `dtype`."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else dtype

    def resolved_quantization(self, model_config: Any = None) -> str | None:
        """`quantization`, or the one a pre-quantized checkpoint's config implies
        (kiln.compiler.fp8_checkpoint; any other quantization_config is refused there)."""
        from kiln.compiler.fp8_checkpoint import checkpoint_quantization

        implied = checkpoint_quantization(model_config) if model_config is not None else None
        return self.quantization or implied

    def compile_options(self, model_config: Any = None, device: torch.device | None = None) -> CompileOptions:
        """What the compiler needs of these options (kiln.compiler.startup): unset batch limits
        take the defaults of `device` (default: the resolved device); with the model's config,
        a pre-quantized checkpoint's implied quantization is included."""
        limits = self.batch_limits(device if device is not None else self.resolved_device())
        return CompileOptions(
            enable_passes=list(self.enable_passes), disable_passes=list(self.disable_passes),
            block_size=self.block_size, max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens, decode_buckets=self.decode_buckets,
            token_buckets=self.token_buckets, mode=self.compile, cache_dir=self.cache_dir,
            require_cache=self.require_cache, progress=self.progress, tp_size=self.tensor_parallel_size,
            quantization=self.resolved_quantization(model_config),
            kv_cache_dtype=torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else None,
            mixed_graph_tokens=0 if self.enforce_eager else min(self.cuda_graph_mixed_tokens,
                                                                limits.max_num_batched_tokens),
        )
