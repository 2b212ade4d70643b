"""One `capture()` per distinct model config in a test process, each caller given a copy.

`torch.export` of a tiny model takes 1-2 s on one CPU thread (the default model's ~13 s), and
the suite's engines and pass tests captured the same configs again and again (in one CI run:
424 captures in the two pytest workers, 205 of them repeats of a capture that worker had
already made, 289 CPU-s of 2,300). A capture is deterministic given its arguments, so this
memo captures each (config, dtype, device, max_num_tokens) once per process and hands every
caller a deep copy of the pristine result: the pass pipeline rewrites the graph it is given
in place, so no caller ever sees another's. A copy run through the pipeline gives the same
code, pass stats, weight transforms and logits (bitwise) as a fresh capture, for every
architecture of `tiny_models.SUPPORTED`.

`tests/conftest.py` installs `shared_capture` where the engine (`kiln.compiler.pipeline`) and
the pass-testing helpers (`kiln.compiler.pass_testing`) call `capture`. It is not installed
as `kiln.compiler.capture.capture` itself: the tests of capture call that and get a real
capture each time. Subprocesses (servers, TP workers, the CLI) never load it.
KILN_TEST_SHARE_CAPTURES=0 turns it off (every call captures).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import torch

from kiln.compiler import capture as capture_module
from kiln.compiler.capture import CapturedModel

# Fields of a config that say where it was read from, not what model it describes, and
# those capture overrides: it picks the model class by `model_type` (never `architectures`)
# and builds in its own dtype argument (transformers' `_from_config` writes that onto its copy
# of the config). A config saved by `save_pretrained` and read back gains `architectures` and
# `dtype`; without them here, the tests that capture a tiny config as built
# (tests/test_shard_tensor_parallel.py) and those that load it from disk (test_parity.py,
# test_fusions_per_arch.py) would capture the same model twice.
_PROVENANCE_FIELDS = ("_name_or_path", "transformers_version", "architectures", "dtype")

_pristine: dict[tuple, CapturedModel] = {}


def enabled() -> bool:
    return os.environ.get("KILN_TEST_SHARE_CAPTURES", "1") != "0"


def _key(config: Any, dtype: torch.dtype, device: torch.device | str, max_num_tokens: int) -> tuple | None:
    """What the captured graph depends on, or None where that cannot be told (then: no memo).

    Besides the arguments, the identity of every function and class of kiln.compiler.capture:
    a test that monkeypatches one of them (test_capture_fake_params does) gets a capture made
    with its patch, never one made before it."""
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    fields = {k: v for k, v in to_dict().items() if k not in _PROVENANCE_FIELDS}
    try:
        described = json.dumps(fields, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return None
    code = tuple(sorted((name, id(v)) for name, v in vars(capture_module).items() if callable(v)))
    return (type(config).__module__, type(config).__qualname__, described, str(dtype), str(torch.device(device)),
            int(max_num_tokens), code)


def _copy(captured: CapturedModel, config: Any) -> CapturedModel:
    # The caller's own config object, as a capture of it would carry; every other field kept
    # (`replace`), the mutable ones copied.
    return dataclasses.replace(captured, graph_module=copy.deepcopy(captured.graph_module), config=config,
                               param_aliases=copy.deepcopy(captured.param_aliases),
                               constants={name: t.clone() for name, t in captured.constants.items()})


def shared_capture(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   max_num_tokens: int = 8192) -> CapturedModel:
    """`kiln.compiler.capture.capture`, made once per distinct key in this process."""
    capture = capture_module.capture  # looked up now: a test's monkeypatch of it is honoured
    key = _key(config, dtype, device, max_num_tokens) if enabled() else None
    if key is None:
        return capture(config, dtype=dtype, device=device, max_num_tokens=max_num_tokens)
    if key not in _pristine:
        # A capture that raises stores nothing: the next caller captures (and raises) again.
        _pristine[key] = capture(config, dtype=dtype, device=device, max_num_tokens=max_num_tokens)
    return _copy(_pristine[key], config)


def install() -> None:
    """Route the engine's and the pass-testing helpers' captures through `shared_capture`."""
    from kiln.compiler import pass_testing, pipeline

    pipeline.capture = shared_capture
    pass_testing.capture = shared_capture
