"""Compile mode "graph": the post-pass FX graph cached as Python source (kiln.compiler.graph_code).

The CUDA default artifact; everything here runs on CPU with compile="graph" asked for
explicitly. The warm start runs in a fresh process (tests/cache_worker.py), so that nothing
captured by the cold engine can leak into it.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_warm_start import TINY_PROMPTS, TINY_SETTINGS, run_worker

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
CLI_FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--buckets", "decode:1", "tokens:16"]


def _setup(model: str):
    """The ModelSetup of an engine with TINY_SETTINGS on CPU (float32), and the store helpers."""
    from kiln.compiler.startup import setup_for_engine
    from kiln.compiler.model_source import resolve_model
    from kiln.runtime.config import EngineConfig

    config = EngineConfig(model=model, device="cpu", **TINY_SETTINGS)
    return setup_for_engine(config.compile_options(), resolve_model(model, "auto").config, torch.float32, CPU)


@pytest.fixture(scope="module")
def cold(tiny_model_dir, tmp_path_factory):
    """A compile="graph" engine on a fresh cache (this process): it captures and stores."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    model = str(tiny_model_dir("llama")[0])
    cache = tmp_path_factory.mktemp("graph-code") / "cache"
    llm = LLM(model, compile="graph", cache_dir=str(cache), num_kv_blocks=64, enable_prefix_caching=False,
              progress=False, **TINY_SETTINGS)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, params)]
    return model, cache, llm.engine, tokens


def _step_inputs(num_tokens: int):
    """A prefill of `num_tokens` tokens of one sequence in block 1 (slots 16...)."""
    from kiln.compiler.graph_inputs import StepInputs

    return StepInputs(
        input_ids=torch.arange(3, 3 + num_tokens).unsqueeze(0),
        position_ids=torch.arange(num_tokens).unsqueeze(0),
        slot_mapping=torch.arange(16, 16 + num_tokens),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        logits_indices=torch.arange(num_tokens),
    )


@pytest.mark.parametrize("fusions", [False, True], ids=["cpu-default", "cuda-fusions"])
def test_code_round_trip_gives_bit_identical_logits(cold, fusions, monkeypatch):
    """The graph's code, stored and loaded, computes exactly what the GraphModule does; also
    with the fusion passes CUDA runs (Kiln's custom ops; their torch references on CPU)."""
    from kiln.compiler.graph_code import GraphCode, load_graph_code, serialize_graph_code

    engine = cold[2]
    if fusions:
        from kiln.runtime.llm import LLM

        monkeypatch.setenv("KILN_CPU_FUSIONS", "1")
        engine = LLM(cold[0], compile="eager", num_kv_blocks=64, progress=False, **TINY_SETTINGS).engine
        assert any(r.stats.get("add_rms_norm") for r in engine.graph.report.records)
    graph = engine.graph
    assert graph is not None  # the cold engine captured
    roles = graph.input_roles()
    code = load_graph_code(serialize_graph_code(graph.graph_module, roles, CPU), roles, CPU)
    assert isinstance(code, GraphCode) and code.num_inputs == len(roles)
    fx_runner = engine.runner.twin(graph.graph_module)
    code_runner = engine.runner.twin(code)
    inputs = _step_inputs(7)
    want = fx_runner.execute(inputs)  # writes the step's K/V; the second run writes the same values
    got = code_runner.execute(inputs)
    assert want.shape == (7, engine.model_config.vocab_size)
    assert torch.equal(got, want)


def test_cold_engine_captures_and_stores_and_a_fresh_process_captures_nothing(cold, tmp_path):
    from kiln.cache.store import ArtifactStore

    model, cache, engine, tokens = cold
    report = engine.startup_report
    assert report.mode == "graph" and report.captured and not report.graph_from_cache
    assert "graph captured and cached" in report.summary() and "graph capture" in report.timings
    with ArtifactStore(cache) as store:
        assert sorted(m.label for m in store.manifests()) == ["config", "graph", "graph-code"]

    fresh = tmp_path / "fresh-inductor-cache"
    warm = run_worker({"model": model, "cache_dir": str(cache), "compile": "graph", "require_cache": True,
                       **TINY_SETTINGS, "prompts": TINY_PROMPTS, "max_tokens": 10},
                      env={"TORCHINDUCTOR_CACHE_DIR": str(fresh)})
    assert warm["mode"] == "graph" and not warm["captured"] and warm["graph_from_cache"]
    assert "graph capture" not in warm["timings"] and "load graph code" in warm["timings"]
    assert warm["counters"] == {} and warm["compile_events"] == []  # no Dynamo, no Inductor
    assert warm["tokens"] == tokens
    # The config came from its snapshot: transformers' config classes were never imported.
    assert warm["model_config_type"] == "ConfigSnapshot"
    assert warm["transformers_config_modules"] == []


@pytest.mark.parametrize("damage", ["unknown global", "broken source", "other input roles"])
def test_unloadable_code_entry_is_dropped_and_rebuilt(cold, tmp_path, damage):
    import shutil

    from kiln.cache.store import ArtifactStore
    from kiln.compiler.startup import prepare_graph
    from kiln.compiler.graph_code import load_graph_code

    model, cache, _, _ = cold
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    setup = _setup(model)
    key = setup.graph_code_key()
    with ArtifactStore(copy) as store:
        entry = store.get(key)
        payload = json.loads(entry.data)
        if damage == "unknown global":
            payload["globals"].append("os")
        elif damage == "broken source":
            payload["src"] = payload["src"][: len(payload["src"]) // 2]
        else:
            payload["input_roles"] = payload["input_roles"][:-1]
        store.put(entry.manifest, json.dumps(payload).encode())  # a valid checksum over bad content

        prepared = prepare_graph(setup, store)
        report = prepared.report
        assert [k for k, _ in report.dropped] == [key]
        assert report.captured and report.stored == [key] and report.mode == "graph"
        assert "1 corrupt entries dropped and rebuilt" in report.summary()
        roles = prepared.spec.input_roles
        load_graph_code(store.get(key).data, roles, CPU)  # the rebuilt entry loads

        again = prepare_graph(setup, store, require_cache=True)
        assert not again.report.captured and again.graph_code is not None and again.graph_fn is again.graph_code


def test_require_cache_names_the_missing_entries(cold, tmp_path):
    import shutil

    from kiln.cache.store import ArtifactStore
    from kiln.compiler.startup import CacheMissError, prepare_graph

    model, cache, _, _ = cold
    setup = _setup(model)
    with ArtifactStore(tmp_path / "empty") as store, pytest.raises(CacheMissError) as err:
        prepare_graph(setup, store, require_cache=True)
    text = str(err.value)
    assert "lacks the graph spec and the graph code" in text
    assert f"graph spec ({setup.model_key()}): miss: the cache is empty" in text
    assert f"graph code ({setup.graph_code_key()})" in text and "kiln compile" in text

    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    with ArtifactStore(copy) as store:
        store.delete(setup.graph_code_key())
        with pytest.raises(CacheMissError) as err:
            prepare_graph(setup, store, require_cache=True)
    text = str(err.value)
    assert "lacks the graph code" in text and "graph spec (" not in text
    assert "the cache holds no graph code entry at all" in text


def test_a_graph_with_module_state_is_refused_and_the_mode_falls_back_to_eager(cold, tmp_path, monkeypatch):
    from kiln.cache.store import ArtifactStore
    from kiln.compiler import startup as aot
    from kiln.compiler.graph_code import GraphCodeError, serialize_graph_code

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))  # reads self.weight / self.bias
    with pytest.raises(GraphCodeError, match="module attribute"):
        serialize_graph_code(gm, ["a"], CPU)

    def refuse(*args, **kwargs):
        raise GraphCodeError("the graph reads 1 module attribute(s)/submodule(s) (get_attr w)")

    monkeypatch.setattr(aot, "serialize_graph_code", refuse)
    with ArtifactStore(tmp_path / "cache") as store:
        prepared = aot.prepare_graph(_setup(cold[0]), store)
        assert store.manifests() == []
    assert prepared.report.mode == "eager" and "cannot be cached as code" in prepared.report.note
    assert prepared.graph_fn is prepared.graph.graph_module


@pytest.mark.parametrize("mode,device,require_cache,cache_dir_given,want", [
    ("auto", CPU, False, False, "warm-or-eager"),
    ("auto", CPU, False, True, "inductor"),
    ("auto", CPU, True, False, "inductor"),
    ("auto", CUDA, False, False, "warm-or-eager"),
    ("auto", CUDA, False, True, "graph"),
    ("auto", CUDA, True, True, "graph"),
    ("inductor", CPU, False, True, "inductor"),
    ("inductor", CUDA, True, True, "inductor"),
    ("graph", CPU, True, False, "graph"),
    ("graph", CUDA, False, False, "graph"),
    ("eager", CPU, False, True, "eager"),
    ("eager", CUDA, False, False, "eager"),
])
def test_resolve_compile_mode(mode, device, require_cache, cache_dir_given, want):
    from kiln.compiler.startup import resolve_compile_mode

    assert resolve_compile_mode(mode, device, require_cache, cache_dir_given) == want


def test_resolve_compile_mode_refuses_bad_combinations():
    from kiln.compiler.startup import resolve_compile_mode

    with pytest.raises(ValueError, match="compile must be one of auto, eager, inductor, graph"):
        resolve_compile_mode("aoti", CPU, False, False)
    with pytest.raises(ValueError, match="--compile eager uses none"):
        resolve_compile_mode("eager", CUDA, True, False)


def test_graph_code_key_differs_from_every_other_kind(cold):
    from kiln.cache.keys import GRAPH_CODE_KIND

    setup = _setup(cold[0])
    code_key = setup.graph_code_key()
    assert code_key.startswith(GRAPH_CODE_KIND + "-")
    assert setup.graph_code_factors()["format"] == "fx-python/1" != setup.model_factors()["format"]
    assert code_key not in {setup.model_key(), *setup.bucket_keys().values()}


def test_kiln_compile_graph_mode_and_cache_commands(cold, tmp_path, capsys):
    from kiln.runtime.cli import main

    model = cold[0]
    cache = str(tmp_path / "cache")
    assert main(["compile", model, "--cache-dir", cache, "--compile", "graph", "--dry-run", *CLI_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "compile mode: graph" in out and out.count("to capture") == 2 and "decode-1" not in out
    assert main(["compile", model, "--cache-dir", cache, "--compile", "graph", *CLI_FLAGS]) == 0
    out = capsys.readouterr().out
    assert out.count("stored") == 2 and "graph captured and cached" in out
    assert main(["compile", model, "--cache-dir", cache, "--compile", "graph", *CLI_FLAGS]) == 0
    out = capsys.readouterr().out
    assert out.count("cache hit") == 2 and "from cache (capture skipped)" in out

    assert main(["cache", "ls", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    code_line = next(line for line in out.splitlines() if line.startswith("graphcode-"))
    assert "graph-code" in code_line and " - " in code_line  # no compile seconds for a non-bucket kind
    key = code_line.split()[0]
    assert main(["cache", "info", key[:16], "--cache-dir", cache]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "graphcode"
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    assert "3 entries ok" in capsys.readouterr().out  # graph spec, graph code, the config's snapshot
    assert main(["cache", "explain", model, "--cache-dir", cache, "--compile", "graph", *CLI_FLAGS]) == 0
    assert "2 of 2 entries would hit" in capsys.readouterr().out
    assert main(["cache", "explain", model, "--cache-dir", cache, *CLI_FLAGS]) == 0  # CPU: inductor buckets
    out = capsys.readouterr().out
    assert "1 of 3 entries would hit" in out and "the cache holds no bucket entry at all" in out


def test_auto_without_a_cache_option_uses_full_graph_code_entries_else_eager(cold, tmp_path, monkeypatch):
    """compile='auto' with no cache option, as on CUDA (artifact "graph"; patched in, since
    this runs on CPU): warm from spec + code when both are cached, else eager, writing nothing."""
    from kiln.cache.store import ArtifactStore
    from kiln.compiler import startup as aot

    model, cache, _, _ = cold
    monkeypatch.setattr(aot, "artifact_mode", lambda device: "graph")
    setup = _setup(model)
    warm = aot._prepare_warm_or_eager(setup, str(cache), progress=False)
    assert warm.report.mode == "graph" and not warm.report.captured and warm.graph_code is not None
    empty = tmp_path / "empty"
    eager = aot._prepare_warm_or_eager(setup, str(empty), progress=False)
    assert eager.report.mode == "eager" and "0 of 2 cache entries present" in eager.report.note
    assert "compile='graph'" in eager.report.note
    with ArtifactStore(empty) as store:
        assert store.manifests() == []
