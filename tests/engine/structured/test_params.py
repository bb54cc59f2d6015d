"""StructuredOutputsParams: shape checks up front, and compile errors that name the problem."""
from __future__ import annotations

import pytest

from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.sampling_params import SamplingParams, SamplingParamsError
from runlm.engine.types.structured_params import StructuredOutputsError, StructuredOutputsParams
from runlm.formats.gguf import GGUFFile
from runlm.formats.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def manager(smollm2_gguf) -> StructuredOutputManager:
    tok = Tokenizer.from_gguf(GGUFFile(smollm2_gguf))
    return StructuredOutputManager(tok, tok.vocab_size, tok.stop_token_ids)


@pytest.mark.parametrize("kwargs, param, words", [
    ({}, "structured_outputs.json", "none was given"),
    ({"regex": "a+", "choice": ["a"]}, "structured_outputs.choice", "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json", "is an object"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice", "non-empty list"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty"),
    ({"grammar": "  "}, "structured_outputs.grammar", "non-empty"),
])
def test_shape_errors_name_the_field(kwargs, param, words) -> None:
    with pytest.raises(StructuredOutputsError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.param == param and words in str(err.value)


def test_sampling_params_takes_a_dict_and_rejects_unknown_fields() -> None:
    p = SamplingParams(structured_outputs={"json": '{"type": "object"}', "disable_any_whitespace": True})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.structured_outputs.json == {"type": "object"} and p.structured_outputs.kind == "json"
    with pytest.raises(SamplingParamsError, match="structured_outputs.jsn: unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(SamplingParamsError, match="expected an object"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize("so, param, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "frob"}}}}, "structured_outputs.json", "frob"),
    ({"json": {"type": "string", "pattern": "a(b"}}, "structured_outputs.json", "unclosed group"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json", "missing"),
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"grammar": "root ::= foo"}, "structured_outputs.grammar", "foo"),
    ({"grammar": "start: 'a' | "}, "structured_outputs.grammar", ""),
])
def test_invalid_constraints_fail_at_compile_naming_the_problem(manager, so, param, words) -> None:
    with pytest.raises(StructuredOutputsError) as err:
        manager.compile(SamplingParams(structured_outputs=so))
    assert err.value.param == param and words in err.value.message


def test_valid_constraints_compile_once_and_are_cached(manager) -> None:
    for so in ({"json": {"type": "object", "properties": {"x": {"type": "integer"}}}}, {"json_object": True},
               {"regex": r"\d+"}, {"choice": ["red", "green"]}, {"grammar": 'root ::= "a" root | "b"'},
               {"grammar": 'start: "x"+'}):
        params = SamplingParams(structured_outputs=so)
        first = manager.compile(params)
        assert first and manager.compile(SamplingParams(structured_outputs=so)) is first
