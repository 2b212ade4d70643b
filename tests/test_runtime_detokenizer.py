"""Incremental detokenizer and stop strings, on the default model's real tokenizer.

The stream must never show a broken UTF-8 character, and the concatenated stream must
equal the final text, both for the detokenizer alone and through the engine (a tiny random
model with the real vocabulary, whose output is full of split multi-byte characters).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.detokenizer import IncrementalDetokenizer, OutputText

from runtime_text_model import text_model_dir

TEXTS = [
    "plain ascii text, with punctuation!",
    "héllo wörld — naïve café",
    "日本語のテキストと中文",
    "emoji 🙂🎉 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "mixed: Ünïcödé 😀 ∑∫ ✓ \n\t tabs and newlines",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return text_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), block_size=16, max_num_batched_tokens=128, progress=False)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_real_text_never_breaks_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    split_chars = sum(tokenizer.decode([t]).count("\ufffd") for t in ids)
    deltas = stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    if "🙂" in text or "日本" in text:
        assert split_chars > 0, "this text should split characters across tokens"


def test_prompt_context_does_not_change_the_text(tokenizer):
    prompt = tokenizer("Once upon a time 日本", add_special_tokens=True)["input_ids"]
    out = tokenizer(" there was 🙂 a café", add_special_tokens=False)["input_ids"]
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), out)
    assert "".join(deltas) == tokenizer.decode(out)


@pytest.fixture(scope="module")
def fragment_ids(tokenizer):
    """Tokens that are pieces of a multi-byte character (decode alone to U+FFFD)."""
    ids = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    assert len(ids) > 100
    return ids


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_concatenated_stream_equals_decode_for_any_tokens(tokenizer, fragment_ids, data):
    # Half the tokens are character fragments, so characters split, complete and break.
    token = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(fragment_ids))
    ids = data.draw(st.lists(token, min_size=1, max_size=30), label="ids")
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert "".join(stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids)) == "user\nhi"
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), ids))
    assert kept == "<|im_start|>user\nhi<|im_end|>"


def feed(tokenizer, text: str, stop: list[str]) -> tuple[OutputText, list[str], str | None]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = OutputText(IncrementalDetokenizer(tokenizer, []), stop)
    deltas, hit = [], None
    for t in ids:
        hit = out.push(t)
        deltas.append(out.take_delta(final=hit is not None))
        if hit:
            break
    if hit is None:
        out.finish()
        deltas.append(out.take_delta(final=True))
    return out, deltas, hit


@pytest.mark.parametrize("text, stop, expected", [
    ("The answer is 42. Next question please", ["Next"], "The answer is 42. "),
    ("alpha beta gamma delta", ["gamma", "beta"], "alpha "),  # the earliest match wins
    ("日本語のテキスト。終わり", ["。"], "日本語のテキスト"),
    ("one two three", ["four"], "one two three"),
    ("tokens across a stop: ABCDEFG", ["CDE"], "tokens across a stop: AB"),
])
def test_stop_strings_cut_exactly_and_never_stream_past(tokenizer, text, stop, expected):
    out, deltas, hit = feed(tokenizer, text, stop)
    assert out.text == expected and "".join(deltas) == expected
    assert hit == (None if expected == text else next(s for s in stop if text.find(s) == len(expected)))
    for s in stop:
        assert all(s not in d for d in deltas)


def test_held_back_text_is_released_when_no_stop_forms(tokenizer):
    out, deltas, hit = feed(tokenizer, "abc abd abe", ["abx"])
    assert hit is None and "".join(deltas) == "abc abd abe"
    assert deltas[-1] != ""  # the last 2 characters waited for the end


# ---- through the engine ----------------------------------------------------------------

def collect(llm: LLM, prompt, params: SamplingParams):
    deltas: list[str] = []
    last = None
    for out in llm.stream(prompt, params):
        deltas.append(out.outputs[0].text_delta)
        assert out.outputs[0].text == "".join(deltas)  # text is always the stream so far
        last = out
    return last, deltas


def test_engine_stream_equals_final_text(llm, tokenizer):
    last, deltas = collect(llm, "Tell me a story about",
                          SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True))
    comp = last.outputs[0]
    assert "".join(deltas) == comp.text
    assert comp.finish_reason == "length" and len(comp.token_ids) == 40
    assert comp.text == tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    assert len(deltas) > 10  # it really streamed


def test_engine_stop_strings_cut_exactly(llm, tokenizer):
    free = llm.generate("The weather today", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    cut = text[: text.index(stop)]
    last, deltas = collect(llm, "The weather today", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                                      stop=[stop]))
    comp = last.outputs[0]
    assert comp.text == cut and "".join(deltas) == cut
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert all(stop not in d for d in deltas)
    assert comp.token_ids == free.outputs[0].token_ids[: len(comp.token_ids)]


def test_engine_stop_token_text_is_not_included(llm, tokenizer):
    free = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[5]
    k = free.token_ids.index(stop_id)
    out = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                               stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: k + 1] and out.stop_reason == stop_id
    assert out.text == tokenizer.decode(free.token_ids[:k], skip_special_tokens=True)


def test_chat_uses_the_chat_template(llm, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert tokenizer.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.apply_chat_template([{"content": "no role"}])


def test_string_prompt_and_n_with_text(llm):
    (out,) = llm.generate("abc", SamplingParams(max_tokens=5, temperature=0.9, seed=1, n=3))
    assert len(out.outputs) == 3 and all(isinstance(c.text, str) for c in out.outputs)
    assert out.prompt == "abc"
