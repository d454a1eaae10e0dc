"""Structured outputs and tool calls over HTTP, through the official `openai` client: response_format (the
client's own `parse()`), vLLM's structured_outputs and guided_* fields, tools with every tool_choice, whole and
streamed. The model is the tiny random one, so only the constraint makes its output valid: each check would fail
without it."""

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 9},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


class Forecast(BaseModel):
    city: str = Field(max_length=10)
    high: int = Field(ge=-50, le=50)
    sunny: bool


def assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(chunks) -> tuple[str, dict[int, dict], str | None]:
    """content, {index: {id, name, arguments}} and the finish reason, as a client assembles a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "a call's id and name come once, in its first chunk"
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_openai_parse_gives_the_pydantic_model(client):
    reply = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Forecast, max_tokens=120,
                                          temperature=1.0, seed=3)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Forecast)
    assert Forecast.model_validate_json(message.content) == message.parsed


def test_json_object_streamed_is_one_json_object(client):
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                            max_tokens=200, temperature=0.7, seed=1, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("field, value, check", [
    ("guided_choice", ["yes", "no", "maybe"], lambda t: t in ("yes", "no", "maybe")),
    ("guided_regex", r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ("structured_outputs", {"grammar": 'root ::= "x" ("y" | "z")+ "."'}, lambda t: re.fullmatch(r"x[yz]+\.", t)),
    ("guided_json", ADD, lambda t: jsonschema.validate(json.loads(t), ADD) is None),
])
def test_completions_follow_vllm_fields(client, field, value, check):
    out = client.completions.create(model="tiny", prompt=["Answer:", "Then"], n=2, max_tokens=64, temperature=1.0,
                                    seed=7, extra_body={field: value})
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_of_masked_tokens_are_clamped_as_vllm_does(client, stream):
    """The choice "a" allows one token where the top 5 are asked for: the other four are masked (-inf, which JSON
    cannot carry: it was a 500) and read -9999.0, as vLLM answers; the sampled token keeps its own logprob."""
    common = dict(model="tiny", max_tokens=4, temperature=0, stream=stream, extra_body={"guided_choice": ["a"]})
    completion = client.completions.create(prompt="Answer:", logprobs=5, **common)
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=5, **common)
    if stream:
        completion, chat = list(completion), list(chat)
        tokens = [c.choices[0].logprobs for c in completion if c.choices and c.choices[0].logprobs]
        top = [t for lp in tokens for t in lp.top_logprobs]
        sampled = [v for lp in tokens for v in lp.token_logprobs]
        entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        top, sampled = completion.choices[0].logprobs.top_logprobs, completion.choices[0].logprobs.token_logprobs
        entries = chat.choices[0].logprobs.content
    assert top and entries
    assert min(min(t.values()) for t in top) == -9999.0 and max(sampled) > -9999.0
    assert min(t.logprob for e in entries for t in e.top_logprobs) == -9999.0
    assert all(len(e.top_logprobs) == 5 and e.logprob > -9999.0 for e in entries)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_calls_tools(client, stream):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=160,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert_valid_calls(message.tool_calls, set(SCHEMAS))
    if stream:
        content, calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        assert content == "" and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]


class Guest(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


class Booking(BaseModel):
    guest: Guest
    others: list[Guest] = Field(max_length=2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_takes_tools_whose_parameters_have_defs(client, stream):
    """The openai client's own tool from a nested pydantic model: its parameters have $defs and $refs into them.
    'required' was a 400 ("Cannot find field '$defs'") where a named choice worked."""
    tool = openai.pydantic_function_tool(Booking)
    assert "$defs" in tool["function"]["parameters"]
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[tool], tool_choice="required", max_tokens=400,
                  parallel_tool_calls=False, temperature=1.0, seed=5)
    if stream:
        _, calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        calls = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        reply = client.chat.completions.create(**kwargs)
        calls, finish = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls], \
            reply.choices[0].finish_reason
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        assert name == "Booking"
        Booking.model_validate_json(arguments)


def test_named_tool_choice_and_one_call_only(client):
    named = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=1.0, seed=2)
    assert named.choices[0].finish_reason == "stop"  # as OpenAI answers a named choice
    assert_valid_calls(named.choices[0].message.tool_calls, {"add"})
    assert len(named.choices[0].message.tool_calls) == 1
    single = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=160, n=3, temperature=1.0, seed=4)
    for choice in single.choices:
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_the_models_own_format(client, stream):
    """tool_choice 'auto' (the default with tools) on "tiny", whose chat template renders tools in Hermes's format:
    the server reads calls with the parser that template implies. A regex makes the random model write text and
    then a call in that format, as a trained model would; the parser turns it into tool_calls."""
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0,
                  extra_body={"guided_regex": "Checking\\. " + re.escape(CALL)})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
        assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template rendered the tools
        message = reply.choices[0].message
        assert message.content == "Checking." and reply.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(message.tool_calls, {"get_weather"})
        assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
        return
    content, calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert content == "Checking." and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}


CUT_CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}, "auto": "auto"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", list(CUT_CHOICES))
def test_a_call_cut_off_by_max_tokens_is_no_call(client, choice, stream):
    """As OpenAI and vLLM answer: finish_reason "length" and no tool call (a named choice cut short came back as
    arguments "{"). Streamed, the call went out as it was written, before its object closed (as OpenAI's and
    vLLM's; chunk counts would depend on the stream interval): the client holds it as far as the cut and nothing
    more (no closing "{}", no content). For 'auto' a regex makes the tiny model write a call in its template's
    format. The uncut output's tokens (its logprobs) say where a cut lands inside the call."""
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=CUT_CHOICES[choice], temperature=0,
                  logprobs=True, extra_body={"guided_regex": re.escape(CALL)} if choice == "auto" else None)
    full = client.chat.completions.create(**kwargs, max_tokens=160)
    assert full.choices[0].finish_reason != "length" and full.choices[0].message.tool_calls
    tokens = [t.token for t in full.choices[0].logprobs.content]
    cut = len(tokens) // 2  # inside the (first) call's object; for 'required' just inside its parameters
    if choice == "required":
        cut = next(k for k in range(len(tokens)) if '"parameters":' in "".join(tokens[:k])) + 1
    assert "{" in "".join(tokens[:cut]) and "}" not in "".join(tokens[:cut]).split("{", 1)[1]
    if stream:
        content, calls, finish = streamed_calls(client.chat.completions.create(**kwargs, max_tokens=cut, stream=True))
        uncut = full.choices[0].message.tool_calls[0].function
        assert [c["name"] for c in calls.values()] == [uncut.name]
        assert uncut.arguments.startswith(calls[0]["arguments"]) and calls[0]["arguments"] != uncut.arguments
        assert finish == "length" and not content
        return
    reply = client.chat.completions.create(**kwargs, max_tokens=cut)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and not message.tool_calls and not message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_cut_off_by_a_stop_string_is_no_call(client, stream):
    """A stop string inside a call ends it as max_tokens does, with finish_reason "stop": never "tool_calls" for a
    call that is not one, though a stream sent it as far as it got."""
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0, stop=["Paris"],
                  extra_body={"guided_regex": re.escape(CALL)})
    if stream:
        content, calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "')]
    else:
        reply = client.chat.completions.create(**kwargs)
        content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert not reply.choices[0].message.tool_calls
    assert finish == "stop" and not content


def test_tool_results_go_back_to_the_model(client):
    """A conversation with an assistant's calls and the tools' answers renders and answers."""
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=160, temperature=0)
    message = first.choices[0].message
    history = MESSAGES + [message, *({"role": "tool", "tool_call_id": c.id, "content": "21 C"}
                                     for c in message.tool_calls)]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=5, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


NESTED_33 = {"type": "integer"}  # subschemas 33 deep
for _ in range(32):
    NESTED_33 = {"type": "object", "properties": {"a": NESTED_33}}


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": []}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {  # minutes of compilation
        "type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(100_000)]}}}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"enum": list(range(1001))}}, "guided_json"),
    ({"guided_choice": [f"c{i}" for i in range(1001)]}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(40_000))}},
     "structured_outputs.grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": NESTED_33}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": f, "parameters": {"enum": list(range(600))}}}
                for f in ("f", "g")], "tool_choice": "required"}, "tools"),  # each within the bounds, not both
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}}}},
     "response_format.json_schema.schema"),  # it was accepted and "a" left unconstrained
    ({"guided_json": {"type": "array", "items": {"$ref": "file:///etc/passwd"}}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "yaml"}}, "response_format"),  # validation names the top-level field
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "add", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=body.pop("messages", MESSAGES), max_tokens=4,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_auto_without_a_parser_is_refused(client):
    """"tiny-queue" has no tool-call parser and its template no known format: 'auto' cannot be read, so it is
    refused; tools with no tool_choice are shown to the model only."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-queue", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                       max_tokens=4)
    assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]
    reply = client.chat.completions.create(model="tiny-queue", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert reply.choices[0].message.tool_calls is None
