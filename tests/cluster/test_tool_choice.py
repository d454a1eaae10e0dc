"""tool_choice "required" and a named function, enforced by the constraint cluster/tool_choice.py builds: on the
tiny random model every output is tool calls whose names are tools and whose arguments validate against them, whole
and streamed; bad tools or choices are errors naming the field."""

import json

import jsonschema
import pytest

from cluster.tool_choice import function_schemas, tool_choice_constraint, tool_parser_for_choice
from cluster.tool_parsers import HermesToolParser, NamedToolParser, RequiredToolParser
from engine.errors import ParamError
from pagoda import LLM, SamplingParams

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                     "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters
]
SCHEMAS = function_schemas(TOOLS)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=256)
    yield llm
    llm.shutdown()


def assert_valid_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_constrained_outputs_are_valid_tool_calls(llm, choice):
    constraint = tool_choice_constraint(TOOLS, choice)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=150, structured_outputs=constraint)
              for seed in range(6)]
    outs = llm.generate(["What is the weather?"] * len(params), params, use_tqdm=False)
    allowed = set(SCHEMAS) if choice == "required" else {"add"}
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        parsed = tool_parser_for_choice(choice, None).parse(completion.text)
        assert parsed.content is None
        assert_valid_calls(parsed.tool_calls, allowed)
        streamed = tool_parser_for_choice(choice, None)
        chunks = [streamed.feed(completion.text[i:i + 3]) for i in range(0, len(completion.text), 3)]
        chunks.append(streamed.finish())
        arguments: dict[int, str] = {}
        for chunk in chunks:
            for delta in chunk.tool_calls:
                arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
        assert list(arguments.values()) == [c.arguments for c in parsed.tool_calls]


DEFS_TOOLS = [  # parameters with $defs and references into themselves, as pydantic writes them
    {"type": "function", "function": {"name": "book", "parameters": {
        "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                             "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["name", "age"], "additionalProperties": False}},
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"},
                                         "others": {"type": "array", "items": {"$ref": "#/$defs/Guest"},
                                                    "maxItems": 2}},
        "required": ["guest", "others"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "tree", "parameters": {  # recursive: '#' is its own root
        "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["v", "kids"], "additionalProperties": False}}},
]


def test_required_takes_parameters_with_defs_and_references(llm):
    """Each schema nested in the array kept its references pointing at its own root ("Cannot find field
    '$defs'"): they are hoisted into the array schema's $defs and rebased there."""
    schemas = function_schemas(DEFS_TOOLS)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                             structured_outputs=tool_choice_constraint(tools, "required"))
              for tools in ([DEFS_TOOLS[0]], [DEFS_TOOLS[1]], DEFS_TOOLS) for seed in range(3)]
    names = set()
    for out in llm.generate(["Book a room"] * len(params), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        for call in tool_parser_for_choice("required", None).parse(completion.text).tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])  # resolves its own $refs
            names.add(call.name)
    assert names == {"book", "tree"}


def test_no_parallel_calls_means_one():
    schema = tool_choice_constraint(TOOLS, "required", parallel_tool_calls=False).json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert tool_choice_constraint(TOOLS, "auto") is None and tool_choice_constraint(TOOLS, "none") is None
    assert tool_choice_constraint(None, None) is None


def test_parsers_for_each_choice():
    assert isinstance(tool_parser_for_choice("required", None), RequiredToolParser)
    named = tool_parser_for_choice({"type": "function", "function": {"name": "add"}}, "hermes")
    assert isinstance(named, NamedToolParser) and named.name == "add"
    assert isinstance(tool_parser_for_choice("auto", "hermes"), HermesToolParser)
    assert isinstance(tool_parser_for_choice(None, "hermes"), HermesToolParser)
    assert tool_parser_for_choice("auto", None) is None and tool_parser_for_choice("none", "hermes") is None


@pytest.mark.parametrize("tools, choice, message", [
    ("x", "required", "tools must be a list"),
    ([{"type": "retrieval"}], "required", "tools[0] must be"),
    ([{"type": "function", "function": {"name": ""}}], "required", "tools[0].function.name must be"),
    ([TOOLS[1], TOOLS[1]], "required", "tools[1].function.name 'add' is not unique"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], "required",
     "tools[0].function.parameters is invalid: Unsupported type"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice names function 'missing'"),
    (TOOLS, {"type": "function"}, "tool_choice must be"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}}}], "required",
     "tools[0].function.parameters has the $ref 'http://example.com/a.json'"),
    ([], "required", "tool_choice 'required' needs at least one tool"),
])
def test_bad_tools_and_choices_name_the_field(tools, choice, message):
    with pytest.raises(ParamError) as e:
        tool_choice_constraint(tools, choice)
    assert str(e.value).startswith(message), str(e.value)
    assert message.startswith(e.value.param)
