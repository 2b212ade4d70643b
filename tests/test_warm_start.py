"""Warm start: artifacts compiled in one process load in another, which compiles nothing.

Every engine here runs in a fresh process (tests/cache_worker.py), because "nothing was
compiled" is read from torch's process-wide compile counters and compile-event timings,
and because the warm process gets its own, empty TORCHINDUCTOR_CACHE_DIR: had it built a
single C++ kernel, files would appear there.

With $KILN_CI_CACHE_DIR set (.ci/run compiles the default model into it, as a user
would), `test_warm_start_from_ci_cache` starts the default model from that cache; without
it, the same test uses the tiny model this module compiles itself. .ci/run compiles in the
background while the tests run, and names in $KILN_CI_COMPILE_STATUS the file where it
writes the compile's exit status when done: that test waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("cache_worker.py")
# Two buckets: decode-1 and tokens-16 (the 23-token prompt is prefilled in two chunks).
TINY_SETTINGS = dict(max_num_seqs=1, max_num_batched_tokens=16, decode_buckets=[1], token_buckets=[16])
TINY_PROMPTS = [[5, 6, 7, 8], list(range(1, 24))]
# Must match the `kiln compile` line of .ci/run.
CI_SETTINGS = dict(max_num_seqs=1, max_num_batched_tokens=32, decode_buckets=[1], token_buckets=[32])
CI_PROMPTS = ["The capital of France is", "Here is a short poem about the sea:"]


def wait_for_ci_compile(timeout_s: float = 1800.0) -> None:
    """Block until .ci/run's background `kiln compile` has finished (no-op outside it); fail
    unless it exited 0."""
    status = os.environ.get("KILN_CI_COMPILE_STATUS")
    if not status:
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(status):
        assert time.monotonic() < deadline, f"kiln compile of .ci/run did not finish in {timeout_s:.0f}s"
        time.sleep(1.0)
    code = Path(status).read_text().strip()
    assert code == "0", f"kiln compile of .ci/run exited with {code} (its log: {Path(status).parent / 'compile.log'})"


def run_worker(opts: dict, env: dict | None = None, expect_ok: bool = True) -> dict | subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(opts)], capture_output=True, text=True,
                          env=full_env, timeout=900)
    if not expect_ok:
        return proc
    assert proc.returncode == 0, f"worker failed:\n{proc.stderr[-4000:]}"
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT: "))
    result = json.loads(line[len("RESULT: "):])
    result["stderr"] = proc.stderr
    return result


def assert_compiled_nothing(result: dict, inductor_dir: Path) -> None:
    counters = result["counters"]
    assert counters.get("frames", {}).get("ok", 0) == 0, f"Dynamo compiled frames: {counters}"
    assert not counters.get("inductor"), f"Inductor ran: {counters.get('inductor')}"
    assert counters == {}, f"compile counters moved: {counters}"
    assert result["compile_events"] == [], f"compile events logged: {result['compile_events']}"
    built = [p for p in inductor_dir.rglob("*") if p.is_file()] if inductor_dir.exists() else []
    assert built == [], f"files were built in the fresh Inductor cache: {built[:5]}"
    assert not result["captured"] and result["graph_from_cache"]


@pytest.fixture(scope="module")
def tiny_cache(tiny_model_dir, tmp_path_factory):
    """A tiny llama compiled (two buckets) into a fresh cache by one process, with its tokens
    and the eager graph's tokens over the same weights."""
    model = str(tiny_model_dir("llama")[0])
    cache = tmp_path_factory.mktemp("warm-start") / "cache"
    cold = run_worker({"model": model, "cache_dir": str(cache), "compile": "inductor", **TINY_SETTINGS,
                       "prompts": TINY_PROMPTS, "max_tokens": 10, "check_eager": True})
    return model, cache, cold


def test_cold_process_compiles_two_buckets_and_matches_eager(tiny_cache):
    _, _, cold = tiny_cache
    assert cold["mode"] == "inductor" and cold["compiled"] == 2 and cold["from_cache"] == 0 and cold["captured"]
    # The detectors used below do see a compile when there is one.
    assert "compile_fx_inner" in cold["compile_events"] and cold["counters"].get("inductor")
    assert cold["tokens"] == cold["eager_tokens"]
    assert set(cold["bucket_counts"]) == {"decode-1", "tokens-16"}


def test_warm_start_loads_both_buckets_and_compiles_nothing(tiny_cache, tmp_path):
    model, cache, cold = tiny_cache
    fresh = tmp_path / "fresh-inductor-cache"
    warm = run_worker({"model": model, "cache_dir": str(cache), "require_cache": True, **TINY_SETTINGS,
                       "prompts": TINY_PROMPTS, "max_tokens": 10},
                      env={"TORCHINDUCTOR_CACHE_DIR": str(fresh)})
    assert warm["tokens"] == cold["tokens"]
    assert warm["from_cache"] == 2 and warm["compiled"] == 0
    assert set(warm["bucket_counts"]) == {"decode-1", "tokens-16"}
    assert_compiled_nothing(warm, fresh)
    assert "graph capture" not in warm["timings"] and "compile" not in warm["timings"]


def test_warm_start_from_ci_cache(tiny_cache, tmp_path):
    """The default model from the cache .ci/run compiled (or the tiny model's, outside CI)."""
    ci_dir = os.environ.get("KILN_CI_CACHE_DIR")
    if ci_dir:
        wait_for_ci_compile()
        opts = {"model": None, "cache_dir": ci_dir, **CI_SETTINGS, "prompts": CI_PROMPTS, "max_tokens": 8,
                "check_eager": True}
    else:
        model, cache, _ = tiny_cache
        opts = {"model": model, "cache_dir": str(cache), **TINY_SETTINGS, "prompts": TINY_PROMPTS, "max_tokens": 10,
                "check_eager": True}
    fresh = tmp_path / "fresh-inductor-cache"
    warm = run_worker({**opts, "require_cache": True}, env={"TORCHINDUCTOR_CACHE_DIR": str(fresh)})
    assert_compiled_nothing(warm, fresh)
    assert warm["from_cache"] == 2
    assert warm["tokens"] == warm["eager_tokens"]
    print(f"warm start ({'default model, CI cache' if ci_dir else 'tiny model'}): first token "
          f"{warm['engine_first_token_seconds']:.2f}s after LLM(), {warm['first_token_seconds']:.2f}s after process "
          f"start; phases {json.dumps({k: round(v, 2) for k, v in warm['timings'].items()})}")


def _bucket_entry_path(cache: Path, label: str) -> tuple[str, Path]:
    from kiln.cache.store import ArtifactStore

    with ArtifactStore(cache) as store:
        (m,) = [m for m in store.manifests() if m.label == label]
        return m.key, store.entry_path(m.key)


def test_truncated_entry_is_reported_rebuilt_and_verified(tiny_cache, tmp_path):
    from kiln.runtime.cli import main

    model, cache, cold = tiny_cache
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    key, path = _bucket_entry_path(copy, "decode-1")
    size = path.stat().st_size
    os.truncate(path, size // 2)
    result = run_worker({"model": model, "cache_dir": str(copy), "compile": "inductor", **TINY_SETTINGS,
                         "prompts": TINY_PROMPTS, "max_tokens": 10})
    assert f"entry {key}" in result["stderr"] and "is corrupt (truncated" in result["stderr"]
    assert [k for k, _ in result["dropped"]] == [key]
    assert result["buckets"]["decode-1"][0] == "compiled" and result["buckets"]["tokens-16"][0] == "hit"
    assert result["tokens"] == cold["tokens"]
    assert main(["cache", "verify", "--cache-dir", str(copy)]) == 0
    assert _bucket_entry_path(copy, "decode-1")[1].stat().st_size > size // 2


def test_require_cache_with_a_corrupt_entry_fails_naming_it(tiny_cache, tmp_path):
    from kiln.compiler.startup import CacheMissError
    from kiln.runtime.llm import LLM

    model, cache, _ = tiny_cache
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    key, path = _bucket_entry_path(copy, "tokens-16")
    os.truncate(path, 100)
    with pytest.raises(CacheMissError) as err:
        LLM(model, cache_dir=str(copy), require_cache=True, progress=False, **TINY_SETTINGS)
    text = str(err.value)
    assert "lacks 1 of 2 bucket(s)" in text and "tokens-16" in text and f"entry {key} was corrupt" in text
    assert "decode-1 (" not in text


def test_require_cache_names_missing_buckets_and_why(tiny_cache):
    from kiln.compiler.startup import CacheMissError
    from kiln.runtime.llm import LLM

    model, cache, _ = tiny_cache
    with pytest.raises(CacheMissError) as err:
        LLM(model, cache_dir=str(cache), require_cache=True, progress=False, max_num_seqs=2,
            max_num_batched_tokens=16, decode_buckets=[1, 2], token_buckets=[16])
    text = str(err.value)
    assert "lacks 2 of 3 bucket(s)" in text
    assert "decode-2" in text and "tokens-16" in text and "decode-1 (" not in text
    assert "bucket.seqs (1 there, 2 here)" in text
    assert "kiln compile" in text


def test_export_then_import_into_an_empty_cache_gives_a_warm_start(tiny_cache, tmp_path):
    from kiln.runtime.cli import main

    model, cache, cold = tiny_cache
    archive = tmp_path / "kiln-cache.tar"
    assert main(["cache", "export", str(archive), "--cache-dir", str(cache)]) == 0
    imported = tmp_path / "imported"
    assert main(["cache", "import", str(archive), "--cache-dir", str(imported)]) == 0
    fresh = tmp_path / "fresh-inductor-cache"
    warm = run_worker({"model": model, "cache_dir": str(imported), "require_cache": True, **TINY_SETTINGS,
                       "prompts": TINY_PROMPTS, "max_tokens": 10}, env={"TORCHINDUCTOR_CACHE_DIR": str(fresh)})
    assert warm["tokens"] == cold["tokens"] and warm["from_cache"] == 2
    assert_compiled_nothing(warm, fresh)


def test_explain_cli_against_the_compiled_cache(tiny_cache, capsys):
    from kiln.runtime.cli import main

    model, cache, _ = tiny_cache
    flags = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--buckets", "decode:1", "tokens:16"]
    assert main(["cache", "explain", model, "--cache-dir", str(cache), *flags]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 entries would hit" in out
    assert main(["cache", "explain", model, "--cache-dir", str(cache), "--dtype", "bfloat16", *flags]) == 0
    out = capsys.readouterr().out
    assert "0 of 3 entries would hit" in out and "differs in dtype: dtype (float32 there, bfloat16 here)" in out
    assert main(["compile", model, "--cache-dir", str(cache), "--dry-run", *flags]) == 0
    out = capsys.readouterr().out
    assert "decode-1" in out and "tokens-16" in out and "to compile" not in out and out.count("cached") == 3


def test_auto_on_cpu_uses_a_full_cache_and_compiles_nothing_otherwise(tiny_cache, tmp_path):
    """With no cache options, a CPU engine starts warm from $KILN_CACHE_DIR when `kiln compile`
    filled it for these settings, and otherwise runs eagerly rather than compiling."""
    model, cache, cold = tiny_cache
    fresh = tmp_path / "fresh-inductor-cache"
    warm = run_worker({"model": model, **TINY_SETTINGS, "prompts": TINY_PROMPTS, "max_tokens": 10},
                      env={"KILN_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(fresh)})
    assert warm["mode"] == "inductor" and warm["from_cache"] == 2 and warm["tokens"] == cold["tokens"]
    assert_compiled_nothing(warm, fresh)
    other = run_worker({"model": model, **{**TINY_SETTINGS, "decode_buckets": [1], "token_buckets": [8, 16]},
                        "prompts": TINY_PROMPTS, "max_tokens": 10},
                       env={"KILN_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(fresh)})
    assert other["mode"] == "eager" and other["compiled"] == 0 and other["compile_events"] == []
    assert other["tokens"] == cold["tokens"]
