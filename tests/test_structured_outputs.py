"""Guided decoding through `LLM.generate`: the engine's logits processor constrains the output
to a JSON schema, a regex or a choice, for a random model whose free text is gibberish, and
unguided requests of the same batch are left alone."""

from __future__ import annotations

import json
import re

import pytest

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.sampling_params import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    from runtime_text_model import text_model_dir

    return LLM(str(text_model_dir(tmp_path_factory)), device="cpu", num_kv_blocks=128, max_num_seqs=4,
               progress=False)


def test_generate_with_a_json_schema_yields_valid_json(llm: LLM) -> None:
    guided = SamplingParams(max_tokens=80, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA))
    free = SamplingParams(max_tokens=20, temperature=0)
    out = llm.generate(["Describe a person as JSON:", "Describe a person as JSON:"], [guided, free])
    text = out[0].outputs[0].text
    value = json.loads(text)
    assert set(value) == {"name", "age", "ok"} and isinstance(value["age"], int) and isinstance(value["ok"], bool)
    assert out[0].outputs[0].finish_reason == "stop"
    with pytest.raises(json.JSONDecodeError):  # the same prompt unguided: the random model's gibberish
        json.loads(out[1].outputs[0].text)
    assert llm.engine.grammar_masker.num_guided == 0  # released when the request finished


def test_regex_and_choice_as_dicts_and_sampled(llm: LLM) -> None:
    regex = SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
    choice = SamplingParams(max_tokens=20, temperature=1.0, seed=2, n=3,
                            structured_outputs={"choice": ["red", "green", "blue"]})
    out = llm.generate(["Code:", "Colour:"], [regex, choice])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out[0].outputs[0].text)
    assert all(c.text in ("red", "green", "blue") for c in out[1].outputs)


def test_bad_constraints_fail_alone_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsonschema": SCHEMA})
    bad_schema = SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "no-such-type"}})
    good = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="structured_outputs.json") as err:
        llm.generate(["a", "b"], [bad_schema, good])
    assert err.value.outputs[1] is not None and len(err.value.outputs[1].outputs[0].token_ids) == 4
