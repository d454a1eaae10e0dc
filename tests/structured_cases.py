"""Constraints the structured-output tests share, and the independent checks of their outputs: jsonschema for JSON,
Python's `re` for regexes, Python's own parser for the EBNF grammar."""

import ast
import json
import re

import jsonschema

from engine.structured_outputs import StructuredOutputsParams

SCHEMAS = {
    "person": {  # required fields, a bounded string, integer bounds, an optional enum
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 130},
                       "role": {"enum": ["admin", "user", None]}},
        "required": ["name", "age"]},
    "nested": {  # nesting, numbers with bounds, an array of enums
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10,
                                                                        "maximum": 10},
                                                                  "y": {"type": "integer", "exclusiveMinimum": 0,
                                                                        "maximum": 50}},
                                 "required": ["x", "y"]},
                       "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                       "ok": {"type": "boolean"}},
        "required": ["point", "tags", "ok"]},
    "records": {  # an array of objects, item bounds, $defs / $ref
        "$defs": {"record": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                     "maximum": 999},
                                                              "score": {"type": "number", "minimum": 0,
                                                                        "maximum": 1}},
                             "required": ["id", "score"]}},
        "type": "array", "items": {"$ref": "#/$defs/record"}, "minItems": 1, "maxItems": 3},
    "patterns": {  # strings with patterns, anyOf with null, a const
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                       "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
                       "version": {"const": 2}},
        "required": ["code", "date", "note", "version"]},
}
REGEX = r"[a-c]{1,4}-(19|20)\d\d(\.[xyz]+)?"
CHOICES = ["yes", "no", "yes please", "it depends"]
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
GRAMMAR = r"""
root ::= expr
expr ::= term ([-+*] term){0,3}
term ::= num | "(" expr ")"
num  ::= [1-9] [0-9]{0,2}
"""


def cases() -> dict[str, StructuredOutputsParams]:
    out = {f"json-{name}": StructuredOutputsParams(json=schema) for name, schema in SCHEMAS.items()}
    out["regex"] = StructuredOutputsParams(regex=REGEX)
    out["choice"] = StructuredOutputsParams(choice=CHOICES)
    out["grammar"] = StructuredOutputsParams(grammar=GRAMMAR)
    return out


def check_output(params: StructuredOutputsParams, text: str) -> None:
    """Raises (AssertionError, ValueError or a jsonschema error) unless text is a complete output of params."""
    if params.json is not None:
        jsonschema.validate(json.loads(text), params.json)
        assert not re.search(r"\s", _JSON_STRING.sub('""', text)), f"not compact: {text!r}"
    elif params.json_object:
        assert isinstance(json.loads(text), dict), text
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), text
    elif params.choice is not None:
        assert text in params.choice, text
    else:
        check_expression(text)


def check_expression(text: str) -> None:
    """An output of GRAMMAR: Python parses it as integers under + - * and parentheses only."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), text
    assert " " not in text, text
