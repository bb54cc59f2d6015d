"""tool_choice -> constraint and parser; tools and tool turns as the chat template sees them."""
from __future__ import annotations

import json

import pytest

from runlm.tools.choice import ToolError, closed_objects, plan_tools
from runlm.tools.prompt import prepare_tool_messages, render_tool_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_TEMPLATE = ("{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                   "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                   "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>"
                   "{% endfor %}{% endfor %}")


def test_auto_parses_the_template_format_without_a_constraint() -> None:
    plan = plan_tools([WEATHER], "auto", HERMES_TEMPLATE)
    assert plan.parser.name == "hermes" and plan.structured_outputs is None and plan.template_tools == [WEATHER]
    assert plan_tools([WEATHER], None, None).parser.name == "hermes"


def test_none_or_no_tools_means_plain_content() -> None:
    for plan in (plan_tools([WEATHER], "none", None), plan_tools(None, None, None), plan_tools(None, "auto", None)):
        assert plan.parser is None and plan.structured_outputs is None and plan.template_tools is None


def test_named_forces_the_function_parameters_schema() -> None:
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert plan.forced and plan.structured_outputs == {"json": closed_objects(WEATHER["function"]["parameters"])}
    assert plan.parser.function == "get_weather"
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert plan.structured_outputs == {"json": {"type": "object", "properties": {}, "additionalProperties": False}}


def test_tool_grammars_admit_only_declared_properties_unless_the_schema_says() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}},
                                               "e": {"type": "object"}},
              "$defs": {"f": {"properties": {"g": {}}, "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["e"]  # a free-form object stays free
    assert closed["$defs"]["f"]["additionalProperties"] is True  # what the schema says wins
    assert "additionalProperties" not in schema  # the tool's own schema is not changed


def test_required_forces_an_array_of_calls_to_the_given_tools() -> None:
    schema = plan_tools([WEATHER, TIME], "required", None).structured_outputs["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [i["properties"]["name"] for i in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "get_time"}]
    assert plan_tools([WEATHER], "required", None, parallel_tool_calls=False).structured_outputs["json"][
        "maxItems"] == 1


@pytest.mark.parametrize("tools, choice, param, words", [
    (None, "required", "tool_choice", "no tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "'nope'"),
    ([WEATHER], "sometimes", "tool_choice", "'sometimes'"),
    ([WEATHER], {"function": "get_weather"}, "tool_choice", "named tool_choice"),
    ([{"type": "retrieval"}], "auto", "tools[0].type", "function"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name", "has space"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name", "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto",
     "tools[0].function.parameters", "JSON schema"),
    ({"type": "function"}, "auto", "tools", "list"),
])
def test_bad_tools_or_tool_choice_name_the_field(tools, choice, param, words) -> None:
    with pytest.raises(ToolError) as err:
        plan_tools(tools, choice, None)
    assert err.value.param == param and words in str(err.value)


def test_templates_that_know_tools_get_them_and_dict_arguments() -> None:
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    text = render_tool_chat(msgs, HERMES_TEMPLATE, tools=[WEATHER])
    assert text.startswith("get_weather;[user]hi[assistant]<tool_call>")
    assert '{"city": "Oslo"}</tool_call>[tool]-3 C' in text  # arguments reached the template as a dict


def test_templates_without_tools_get_a_hermes_system_prompt_and_tool_turns() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    out, tools = prepare_tool_messages(msgs, [WEATHER], None)
    assert tools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"
    assert prepare_tool_messages(msgs[1:2], None, None) == (msgs[1:2], None)  # nothing about tools: unchanged
