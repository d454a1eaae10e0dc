"""What a request's JSON schema says beyond its fields' types, so that /openapi.json says what the server accepts:

    the edge's cross-field checks (cluster/protocol.py)      e.g. tool_choice needs tools, stream_options needs stream
    each served model's bounds (its replicas' model_info)   token ids below its vocabulary, n up to max_num_seqs, ...

What no JSON schema can say stays a 400 that names it: a prompt's length in tokens (the tokenizer decides) beside
max_tokens, min_tokens above max_tokens, a grammar, regex or JSON schema that does not compile, a named tool_choice
that names no tool, tool names that repeat, a chat template that fails on the messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.tokenizer import RESERVED_TEMPLATE_KWARGS

NOT_NULL = {"not": {"type": "null"}}
# The fields that constrain the output (at most one may), and when each counts as given.
_OUTPUT_FIELDS = {"response_format": {"type": "object", "required": ["type"],
                                      "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
                  **{name: NOT_NULL for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                                 "guided_grammar")}}


@dataclass(frozen=True)
class ModelFacts:
    """What the schema needs of a served model (cluster/server.py model_info, the ingress's max_prompts)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_prompt_chars: int
    tool_call_parser: str | None = None
    allow_request_chat_template: bool = False
    max_prompts: int | None = None  # prompts one completion request may batch

    @classmethod
    def from_info(cls, info: dict, max_prompts: int | None) -> ModelFacts:
        return cls(info["vocab_size"], info["max_model_len"], info["max_num_seqs"], info["max_prompt_chars"],
                   info.get("tool_call_parser"), bool(info.get("allow_request_chat_template")), max_prompts)


def _given(name: str, value: dict) -> dict:
    return {"required": [name], "properties": {name: value}}


def _when(condition: dict, then: dict) -> dict:
    return {"if": condition, "then": then}


# ... and when it does not: absent, null, or (response_format) the type "text"
_OUTPUT_NOT_GIVEN = {"response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
                     **{name: {"type": "null"} for name in _OUTPUT_FIELDS if name != "response_format"}}


def _at_most_one_output() -> dict:
    """At most one of _OUTPUT_FIELDS is given: for some field, every other is not."""
    return {"anyOf": [{"properties": {other: _OUTPUT_NOT_GIVEN[other] for other in _OUTPUT_FIELDS if other != name}}
                      for name in _OUTPUT_FIELDS]}


def _shared_rules() -> list[dict]:
    return [_when(_given("stream_options", NOT_NULL), _given("stream", {"const": True})), _at_most_one_output(),
            _when(_given("allowed_token_ids", NOT_NULL), {"properties": _OUTPUT_NOT_GIVEN})]


def _completion_rules() -> list[dict]:
    return [*_shared_rules(), _when(_given("best_of", {"const": 1}), {"properties": {"n": {"const": 1}}})]


def _chat_rules() -> list[dict]:
    tool_constraint = {"anyOf": [{"const": "required"}, {"type": "object"}]}  # a grammar too
    return [
        *_shared_rules(),
        _when(_given("top_logprobs", NOT_NULL), _given("logprobs", {"const": True})),
        _when(_given("prompt_logprobs", NOT_NULL), {"properties": {"stream": {"const": False}}}),
        _when(_given("tool_choice", NOT_NULL), _given("tools", {"type": "array", "minItems": 1})),
        _when(_given("tool_choice", tool_constraint), {"properties": {**_OUTPUT_NOT_GIVEN,
                                                                     "allowed_token_ids": {"type": "null"}}}),
        # parallel_tool_calls false holds a 'required' or named choice to one call; under 'auto' the model decides
        _when(_given("parallel_tool_calls", {"const": False}), {"anyOf": [
            _given("tool_choice", {"anyOf": [{"enum": ["none", "required"]}, {"type": "object"}]}),
            {"properties": {"tool_choice": {"type": "null"},
                            "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}]}),
        _when(_given("continue_final_message", {"const": True}),
              {"properties": {"add_generation_prompt": {"const": False}}}),
    ]


def _response_format_rules() -> list[dict]:
    return [_when({"properties": {"type": {"const": "json_schema"}}}, _given("json_schema", NOT_NULL))]


# component name -> the cross-field rules of that request model
SHAPE_RULES = {"CompletionRequest": _completion_rules, "ChatCompletionRequest": _chat_rules,
               "ResponseFormat": _response_format_rules}


def integers_below(n: int) -> str:
    """A regex of the decimal integers 0 .. n-1, written without leading zeros (logit_bias's keys)."""
    top = str(n - 1)
    alternatives = ["0"]
    if len(top) > 1:
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")  # the shorter numbers
    for i, digit in enumerate(top):  # a number of top's length: top's prefix, then a smaller digit, then any
        low = 1 if i == 0 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    alternatives.append(top)
    return f"^({'|'.join(dict.fromkeys(alternatives))})$"


def _bounds(component: str, facts: ModelFacts) -> dict[str, dict]:
    """A served model's bounds on a request's fields (each a schema the field's value also matches)."""
    last_id = facts.vocab_size - 1
    ids = {"items": {"maximum": last_id}}
    longest = facts.max_model_len - 1  # a prompt takes at least one token
    reserved = sorted((RESERVED_TEMPLATE_KWARGS - {"chat_template"})
                      | (set() if facts.allow_request_chat_template else {"chat_template"}))
    template_kwargs = {"propertyNames": {"not": {"enum": reserved}}}
    generation = {"stop_token_ids": ids, "allowed_token_ids": ids, "n": {"maximum": facts.max_num_seqs},
                  "logit_bias": {"propertyNames": {"pattern": integers_below(facts.vocab_size)}},
                  "max_tokens": {"maximum": longest}, "truncate_prompt_tokens": {"maximum": longest}}
    if component == "CompletionRequest":
        prompt = {"items": {"maximum": last_id, "items": {"maximum": last_id}}}
        if facts.max_prompts is not None:  # a list of token ids is one prompt; a list of strings or lists, one each
            prompt["anyOf"] = [{"not": {"type": "array"}}, {"items": {"type": "integer"}},
                               {"maxItems": facts.max_prompts}]
        return {**generation, "prompt": prompt}
    if component == "ChatCompletionRequest":
        bounds = {**generation, "max_completion_tokens": {"maximum": longest}, "chat_template_kwargs": template_kwargs}
        if facts.tool_call_parser is None:  # 'auto' reads calls in the model's own format: it has none
            bounds["tool_choice"] = {"not": {"const": "auto"}}
        return bounds
    if component == "TokenizeRequest":
        return {"chat_template_kwargs": template_kwargs}
    if component == "DetokenizeRequest":
        return {"tokens": ids}
    return {}


# A bound that only narrows what the context length allows: where models differ, the loosest holds for all (the
# rest is a 400 about the context, which no schema can state exactly anyway).
_LOOSEST = {"max_tokens", "max_completion_tokens", "truncate_prompt_tokens"}


def model_rules(component: str, facts: dict[str, ModelFacts], model_names: list[str]) -> list[dict]:
    """Each field's bounds: for all models where they agree, else for the models that share each (a few
    conditions, not one per model: generators expand every condition)."""
    bounds = {name: _bounds(component, facts[name]) for name in model_names if name in facts}
    if not bounds:
        return []
    unconditional, rules = {}, []
    for field in dict.fromkeys(f for b in bounds.values() for f in b):
        groups: dict[str, list[str]] = {}
        for name in model_names:
            if name not in bounds:
                groups.setdefault("null", []).append(name)  # a model without facts: no bound
                continue
            groups.setdefault(json.dumps(bounds[name].get(field), sort_keys=True), []).append(name)
        if len(groups) == 1 and "null" not in groups:
            unconditional[field] = json.loads(next(iter(groups)))
        elif field in _LOOSEST and "null" not in groups:
            unconditional[field] = {"maximum": max(json.loads(g)["maximum"] for g in groups)}
        else:
            rules += [_when(_given("model", {"enum": names}), {"properties": {field: json.loads(bound)}})
                      for bound, names in groups.items() if bound != "null"]
    return ([{"properties": unconditional}] if unconditional else []) + rules


def add_rules(components: dict[str, Any], model_names: list[str], facts: dict[str, ModelFacts]) -> None:
    """The cross-field rules and the served models' bounds into the request components; where several models are
    served, `model` is required."""
    for name, rules in SHAPE_RULES.items():
        if name in components:
            components[name].setdefault("allOf", []).extend(rules())
    for component in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        if component not in components:
            continue
        schema = components[component]
        if len(model_names) > 1:
            schema["required"] = sorted({*schema.get("required", []), "model"})
        rules = model_rules(component, facts, model_names)
        if rules:
            schema.setdefault("allOf", []).extend(rules)
