"""`LLM` / `SamplingParams` / outputs as a vLLM user calls them (tiny model, real tokenizer),
and a vLLM-style offline script run unchanged except for its import lines."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime import cli
from kiln.runtime import LLM, GenerateError, Logprob, SamplingParams, TextPrompt, TokensPrompt, __version__
from kiln.runtime.config import EngineConfig
from kiln.runtime.sampler import Sampler
from kiln.runtime.sequence import Sequence

from hub_cache import add_to_hub_cache
from runtime_text_model import text_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(str(text_model_dir(tmp_path_factory)), progress=False, max_model_len=256, num_kv_blocks=64)


def tokens(llm: LLM, prompt, params=GREEDY) -> list[int]:
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_every_prompt_form_vllm_accepts(llm) -> None:
    ids = llm.get_tokenizer()("The capital of France is")["input_ids"]
    want = tokens(llm, ids)
    outs = llm.generate(["The capital of France is", ids, {"prompt": "The capital of France is"},
                         {"prompt_token_ids": ids}, TextPrompt(prompt="The capital of France is"),
                         TokensPrompt(prompt_token_ids=ids)], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 6
    assert [o.prompt_token_ids for o in outs] == [ids] * 6
    assert outs[0].prompt == outs[2].prompt == "The capital of France is" and outs[3].prompt is None
    # One dict alone is one prompt (it used to generate from the dict's key as text).
    (one,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == [1, 2, 3]


def test_bad_prompts_fail_alone_with_their_index(llm) -> None:
    with pytest.raises(GenerateError) as err:
        llm.generate([{"prompt_tokens": [1]}, "fine", {"prompt": "x", "multi_modal_data": {}}, 3.5,
                      {"prompt_token_ids": ["a"]}], GREEDY, use_tqdm=False)
    assert set(err.value.errors) == {0, 2, 3, 4}
    assert "unknown key(s) prompt_tokens" in err.value.errors[0]
    assert "multi_modal_data is not supported" in err.value.errors[2]
    assert "got float" in err.value.errors[3] and "prompt_token_ids must be" in err.value.errors[4]
    assert err.value.outputs[1] is not None and err.value.outputs[1].outputs[0].token_ids
    with pytest.raises(TypeError, match="prompts must be a prompt or a list of prompts"):
        llm.generate(42, GREEDY)  # type: ignore[arg-type]


def test_truncate_prompt_tokens_keeps_the_last_ones(llm) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens run (-1: up to max_model_len),
    as if the prompt were those alone; a value that is neither is refused naming the field."""
    ids = llm.get_tokenizer()("The capital of France is a city of")["input_ids"]
    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=3),
                          use_tqdm=False)
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == tokens(llm, ids[-3:])
    long = (ids * 40)[:300]  # over max_model_len (256): runs once cut to its last 250
    (cut,) = llm.generate([long], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=250),
                          use_tqdm=False)
    assert cut.prompt_token_ids == long[-250:] and len(cut.outputs[0].token_ids) == 4
    # -1: up to max_model_len (which leaves no room to generate, as in vLLM: the usual error)
    assert SamplingParams(truncate_prompt_tokens=-1).truncated_prompt(long, 256) == long[-256:]
    with pytest.raises(GenerateError, match="max_tokens"):
        llm.generate([long], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_detokenize_false_returns_token_ids_alone(llm) -> None:
    """vLLM's `detokenize=False` (its throughput benchmark's --disable-detokenize): the same
    tokens, no text, logprobs without decoded tokens; stop strings, matched in the text, are
    refused with it."""
    ids = llm.get_tokenizer()("The capital of France is")["input_ids"]
    params = dict(temperature=0, max_tokens=6, logprobs=1)
    (text,) = llm.generate([ids], SamplingParams(**params), use_tqdm=False)
    (bare,) = llm.generate([ids], SamplingParams(**params, detokenize=False), use_tqdm=False)
    assert bare.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert bare.outputs[0].text == ""
    assert all(lp.decoded_token is None for entry in bare.outputs[0].logprobs for lp in entry.values())
    assert all(lp.decoded_token is not None for entry in text.outputs[0].logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)


def test_progress_bar_by_default_as_vllm(llm, capfd) -> None:
    llm.generate(["a", "b"], GREEDY)
    assert "Processed prompts: 100%" in capfd.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capfd.readouterr().err


def test_chat_template_options(llm) -> None:
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ greeting }}"
    out = llm.chat(conv, GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "Bot:"})[0]
    assert out.prompt_token_ids == tok("<user>hi" + "Bot:", add_special_tokens=False)["input_ids"]
    with_prompt = llm.apply_chat_template(conv)
    without = llm.apply_chat_template(conv, add_generation_prompt=False)
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    with pytest.raises(ValueError, match="chat_template_kwargs: tokenize is set by chat"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": False})


def test_top_k_zero_is_off_as_minus_one(llm) -> None:
    a = tokens(llm, "Once", SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=8))
    b = tokens(llm, "Once", SamplingParams(temperature=1.0, top_k=-1, seed=3, max_tokens=8))
    assert a == b
    with pytest.raises(ValueError, match="top_k must be 0 or -1"):
        SamplingParams(top_k=-2)


def test_logit_bias_allowed_token_ids_bad_words(llm) -> None:
    assert tokens(llm, "Once", SamplingParams(temperature=0, max_tokens=4, logit_bias={"42": 100})) == [42] * 4
    assert set(tokens(llm, "Once", SamplingParams(temperature=0.9, max_tokens=12, seed=1,
                                                   allowed_token_ids=[7, 9, 11]))) <= {7, 9, 11}
    free = llm.generate("Hello there", GREEDY, use_tqdm=False)[0].outputs[0]
    word = llm.get_tokenizer().decode(free.token_ids[:1]).strip()
    banned = llm.get_tokenizer()(" " + word, add_special_tokens=False)["input_ids"]
    out = tokens(llm, "Hello there", SamplingParams(temperature=0, max_tokens=6, bad_words=[word]))
    assert out[0] != free.token_ids[0] and banned[-1] not in out
    with pytest.raises(ValueError, match=r"logit_bias must map token ids.*\[-100, 100\]"):
        SamplingParams(logit_bias={1: 500})
    with pytest.raises(GenerateError, match="allowed_token_ids: token ids .* outside the vocabulary"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**9]), use_tqdm=False)


def test_include_stop_str_in_output(llm) -> None:
    free = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = free.text[3:6]
    cut = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    kept = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == kept.finish_reason == "stop" and cut.stop_reason == stop
    assert kept.text == cut.text + stop and not cut.text.endswith(stop)


def test_logprobs_as_vllm_returns_them(llm) -> None:
    out = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert isinstance(entry[token], Logprob) and entry[token].rank == 1  # greedy
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))
    assert llm.generate("x", GREEDY, use_tqdm=False)[0].outputs[0].cumulative_logprob is None


def test_prompt_logprobs_match_the_sampled_ones(llm) -> None:
    """The logprob of a prompt token (from its prefill row) equals the logprob it had when
    it was generated (from a sampled row); twice, so the second run would hit the prefix cache."""
    prompt = llm.get_tokenizer()("Once upon a time there")["input_ids"]
    gen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False)[0]
    extended = prompt + gen.outputs[0].token_ids
    for _ in range(2):
        out = llm.generate(extended, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(extended) and out.prompt_logprobs[0] is None
        for k, token in enumerate(gen.outputs[0].token_ids):
            entry = out.prompt_logprobs[len(prompt) + k]
            assert entry[token].logprob == pytest.approx(gen.outputs[0].logprobs[k][token].logprob, abs=1e-4)
            assert entry[token].rank == 1  # it was the greedy choice
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert extended[position] in entry and {1, 2} <= {lp.rank for lp in entry.values()}
    assert llm.generate("x", GREEDY, use_tqdm=False)[0].prompt_logprobs is None


def test_engine_seed_makes_unseeded_draws_repeat() -> None:
    """LLM(seed=...) seeds the sampler's generator for requests without a seed."""
    def draws(seed):
        sampler = Sampler(seed=seed)
        seqs = [Sequence(seq_id=i, request_id=str(i), prompt_token_ids=[1], params=SamplingParams(temperature=1.0))
                for i in range(4)]
        logits = torch.zeros(4, 1000)
        return [sampler.sample(logits, seqs).token_ids for _ in range(3)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    assert EngineConfig(seed=7, enforce_eager=True).seed == 7
    with pytest.raises(ValueError, match="seed must be an integer"):
        EngineConfig(seed="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="did you mean 'enforce_eager'"):
        EngineConfig.from_options(None, enforce_eagre=True)


def test_version(capsys) -> None:
    assert __version__ and __version__[0].isdigit()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kiln {__version__}"


# vLLM's offline examples, as a vLLM user has them; only the import lines change.
VLLM_OFFLINE_SCRIPT = '''
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512, seed=0, enforce_eager=True,
          gpu_memory_utilization=0.5)

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

tokenizer = llm.get_tokenizer()
token_ids = tokenizer.encode("The capital of France is")
greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
out = llm.generate({"prompt_token_ids": token_ids}, greedy)[0]
print("TOKENS", out.outputs[0].token_ids, out.outputs[0].cumulative_logprob < 0)
for position in out.outputs[0].logprobs:
    for token_id, logprob in position.items():
        assert logprob.rank >= 1 and isinstance(logprob.decoded_token, str)

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
]
outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print("CHAT", outputs[0].outputs[0].finish_reason)

choice = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
outputs = llm.generate("Classify this sentiment: vLLM is wonderful!", choice)
print("CHOICE", outputs[0].outputs[0].text)
'''


def test_vllm_offline_script_runs_unchanged_but_for_imports(tmp_path, tmp_path_factory, monkeypatch, capsys) -> None:
    """The script runs as a user runs it (its model a hub id, found in the Hugging Face cache
    that $HF_HUB_CACHE names, offline), in this process to spare a second torch import."""
    script = (VLLM_OFFLINE_SCRIPT.replace("from vllm import", "from kiln.runtime import")
              .replace("from vllm.sampling_params import", "from kiln.runtime.sampling_params import"))
    assert "vllm" not in script.replace("vLLM is wonderful", "")
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", text_model_dir(tmp_path_factory))
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", str(cache)), ("KILN_CACHE_DIR", str(tmp_path))):
        monkeypatch.setenv(name, value)
    exec(compile(script, "offline_inference.py", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert sum(line.startswith("Prompt: 'The capital of France is'") for line in lines) == 1
    assert any(line.startswith("TOKENS [") and line.endswith("True") for line in lines)
    assert "CHAT stop" in lines or "CHAT length" in lines
    assert "CHOICE Positive" in lines or "CHOICE Negative" in lines
    assert "Processed prompts" in out.err  # vLLM's progress bar, on by default


@pytest.mark.parametrize("command", [["serve"], ["compile"], ["cache", "explain"], ["chat"], ["passes", "show"]])
def test_model_positional_or_flag_on_every_command(command) -> None:
    parser = cli.build_parser()
    for argv in (command + ["org/name"], command + ["--model", "org/name"]):
        args = parser.parse_args(argv)
        cli.merge_model_option(args)
        assert args.model == "org/name", argv
    args = parser.parse_args(command + ["org/a", "--model", "org/b"])
    with pytest.raises(ValueError, match="given twice"):
        cli.merge_model_option(args)
    # generate keeps its prompts positional: the model is --model there.
    assert parser.parse_args(["generate", "--model", "org/name", "Hi"]).model == "org/name"
