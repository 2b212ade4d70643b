"""`kiln compile` as a user runs it: concurrent compiles of one key, and a failing bucket."""

from __future__ import annotations

import os
import subprocess
import sys

from kiln.cache.store import ArtifactStore

FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--buckets", "decode:1", "tokens:16"]


def _kiln(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _results(table: str) -> dict[str, str]:
    """bucket -> 'compiled' | 'cache hit' | 'failed', from kiln compile's table."""
    return {bucket: result for bucket, (result, _) in _rows(table).items()}


def _rows(table: str) -> dict[str, tuple[str, str]]:
    """bucket -> (result, seconds column), from kiln compile's table."""
    out = {}
    for line in table.splitlines():
        parts = line.split()
        if parts and parts[0] in ("decode-1", "tokens-16"):
            hit = parts[1:3] == ["cache", "hit"]
            out[parts[0]] = ("cache hit", parts[3]) if hit else (parts[1], parts[2])
    return out


def test_two_processes_compiling_the_same_keys_at_once_both_succeed(tiny_model_dir, tmp_path):
    """Both `kiln compile` runs finish with every bucket; each bucket was compiled by exactly
    one of them (the other waited on the key's lock and then found it); the cache verifies."""
    from kiln.runtime.cli import main

    model = str(tiny_model_dir("llama")[0])
    cache = str(tmp_path / "cache")
    procs = [_kiln("compile", model, "--cache-dir", cache, *FLAGS) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [_results(out) for out, _ in outs]
    for bucket in ("decode-1", "tokens-16"):
        assert sorted(r[bucket] for r in results) == ["cache hit", "compiled"], results
    # The process that waited for the other's compile reports the wait apart, not as seconds
    # it spent compiling: its hit rows take a read, and its phases name the wait.
    for out, _ in outs:
        for bucket, (result, seconds) in _rows(out).items():
            if result == "cache hit":
                assert float(seconds) < 1.0, out
                if "graph captured" in out:  # it missed at first, so it found the entry after the lock
                    assert "waited for another process" in out, out
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    with ArtifactStore(cache) as store:
        labels = sorted(m.label for m in store.manifests())
    assert labels == ["config", "decode-1", "graph", "tokens-16"]  # config: the config.json's snapshot


def test_compile_exits_nonzero_when_a_bucket_fails(tiny_model_dir, tmp_path):
    """With no working C++ compiler (CXX=false) every CPU bucket fails: the table says so,
    stderr names each bucket, the exit status is 1, and nothing is stored for them."""
    model = str(tiny_model_dir("llama")[0])
    cache = str(tmp_path / "cache")
    proc = _kiln("compile", model, "--cache-dir", cache, *FLAGS,
                 env={"CXX": "false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 1, (out, err[-3000:])
    assert _results(out) == {"decode-1": "failed", "tokens-16": "failed"}
    assert "bucket decode-1 failed" in err and "bucket tokens-16 failed" in err
    with ArtifactStore(cache) as store:
        assert sorted(m.label for m in store.manifests()) == ["config", "graph"]  # no bucket


def test_compile_dry_run_prints_the_plan_and_compiles_nothing(tiny_model_dir, tmp_path, capsys):
    from kiln.runtime.cli import main

    model = str(tiny_model_dir("llama")[0])
    assert main(["compile", model, "--cache-dir", str(tmp_path / "c"), "--dry-run", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "64"]) == 0
    out = capsys.readouterr().out
    for name in ("decode-1", "decode-2", "decode-4", "tokens-16", "tokens-32", "tokens-64"):
        assert name in out
    assert out.count("to compile") == 7  # the graph spec and six buckets
    with ArtifactStore(tmp_path / "c") as store:
        assert store.manifests() == []
    assert main(["compile", model, "--cache-dir", str(tmp_path / "c"), "--dry-run", "--buckets", "prefill:4"]) == 2
    assert "expected 'decode:N,N,...'" in capsys.readouterr().err
