"""`tool_choice` as a constraint: "required" and a named function are enforced with a grammar (vLLM's way), "auto"
reads the model's own format with a `--tool-call-parser` (cluster/tool_parsers.py), "none" leaves the output alone.

    "required"                              [{"name": "f", "parameters": {...f's schema...}}, ...]  one or more
    {"type": "function", "function": {...}} {...the function's parameters schema...}

Under "required" each function's parameters schema sits in the array schema's `$defs` (tool_0, tool_1, ...), its
own references ('#/$defs/x', '#') rebased there, so that a schema with `$defs` works as it does on its own.

`tool_choice_constraint` gives the StructuredOutputsParams to sample with; `tool_parser_for_choice` the parser that
turns that output (whole or streamed) into tool calls.
"""

from __future__ import annotations

from cluster.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser, get_tool_parser
from engine.errors import ParamError
from engine.structured_outputs import StructuredOutputsParams, rebase_refs

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def function_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """name -> parameters schema of OpenAI `tools` entries; ParamError naming the bad field."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise ParamError("tools", "must be a list")
    schemas = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function,
                                                                                                        dict):
            raise ParamError(f"tools[{i}]", "must be {'type': 'function', 'function': {...}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ParamError(f"tools[{i}].function.name", "must be a non-empty string")
        if name in schemas:
            raise ParamError(f"tools[{i}].function.name", f"{name!r} is not unique")
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        try:
            StructuredOutputsParams(json=parameters)
        except ParamError as e:  # "structured_outputs.json is invalid: ..." -> "tools[0].function.parameters is ..."
            raise e.renamed(f"tools[{i}].function.parameters") from None
        schemas[name] = parameters
    return schemas


def named_function(tool_choice) -> str | None:
    """The function a named tool_choice names; None for the string choices."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise ParamError("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                                            "{'name': ...}}")
        return function["name"]
    if tool_choice not in (None, "none", "auto", "required"):
        raise ParamError("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
    return None


def tool_choice_constraint(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool = True,
                           ) -> StructuredOutputsParams | None:
    """The constraint that enforces tool_choice, or None ('none', 'auto', or no tools with no choice)."""
    schemas = function_schemas(tools)
    name = named_function(tool_choice)
    if name is not None:
        if name not in schemas:
            raise ParamError("tool_choice", f"names function {name!r}, which is not in tools")
        return StructuredOutputsParams(json=schemas[name])
    if tool_choice != "required":
        return None
    if not schemas:
        raise ParamError("tool_choice", "'required' needs at least one tool in tools")
    calls, defs = [], {}
    for i, (function, parameters) in enumerate(schemas.items()):
        defs[f"tool_{i}"] = rebase_refs(parameters, f"#/$defs/tool_{i}")
        calls.append({"type": "object", "properties": {"name": {"const": function},
                                                       "parameters": {"$ref": f"#/$defs/tool_{i}"}},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
              "$defs": defs}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    try:
        return StructuredOutputsParams(json=schema)
    except ParamError as e:  # each schema passed alone: what fails is all of them together (too large)
        raise e.renamed("tools") from None


def tool_parser_for_choice(tool_choice, auto_parser: str | None) -> ToolParser | None:
    """The parser of an output under tool_choice: the constrained formats, the model's own for 'auto' and None (the
    default when tools are given; no parser when the server has no --tool-call-parser), no parser for 'none'."""
    name = named_function(tool_choice)
    if name is not None:
        return NamedToolParser(name)
    if tool_choice == "required":
        return RequiredToolParser()
    if tool_choice == "none" or auto_parser is None:
        return None
    return get_tool_parser(auto_parser)
