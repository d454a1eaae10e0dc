"""Tool-call parsers (hermes, llama3_json, and the outputs tool_choice constrains): whole outputs, and streams of
any split whose deltas add up to the whole parse, in OpenAI's chunk shape, calls streaming as they are written (plus,
for an output cut inside a call, that call as far as it got)."""

import itertools
import json
import random

import pytest

from cluster.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    get_tool_parser,
    tool_parser_for_template,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "nested": {"a": [1, "}{", {"b": "\\"]"}]}}}'

HERMES_OUTPUTS = [
    f"I will check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"<tool_call>{WEATHER}</tool_call>",
    "No tools needed: 2 < 3 and <tool is not a tag.",
    "An answer with trailing space and a lonely tag start <tool_c",
    f"<tool_call>{WEATHER}</tool_call> and some words after",
    "<tool_call>not json at all</tool_call> then text",
    '<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>',
    '<tool_call>{"name": "no_args"}</tool_call>',
    '<tool_call>{"name": "stringly", "arguments": "{\\"q\\": 1}"}</tool_call>',
    '<tool_call>\n{"name": "cut_off", "arguments": {"city": "Par',  # max_tokens ran out
    "<tool_call>",
    "",
]
LLAMA_OUTPUTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [2, 3]}}',
    '  {"name": "a", "arguments": {}}',
    "The answer is 42, no function needed.",
    '{"answer": {"name": "not a call"}}',
    '{"name": "a", "parameters": {"x": 1}} trailing words',
    '{"name": "cut", "parameters": {"x": "unfin',
    "   ",
]
REQUIRED_OUTPUTS = ['[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]',
                    '[{"name":"get_weather","parameters":{"city":"Par']


def test_hermes_whole_output():
    parsed = HermesToolParser().parse(HERMES_OUTPUTS[0])
    assert parsed.content == "I will check."
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(parsed.tool_calls[1].arguments) == json.loads(TIME)["arguments"]
    assert len({c.id for c in parsed.tool_calls}) == 2 and parsed.tool_calls[0].id.startswith("call_")
    plain = HermesToolParser().parse(HERMES_OUTPUTS[2])
    assert plain.content == HERMES_OUTPUTS[2] and not plain.tool_calls  # untouched, character for character
    after = HermesToolParser().parse(HERMES_OUTPUTS[4])
    assert after.content == "and some words after" and len(after.tool_calls) == 1
    bad = HermesToolParser().parse(HERMES_OUTPUTS[5])
    assert bad.content == "<tool_call>not json at all</tool_call>then text" and not bad.tool_calls
    late = HermesToolParser().parse(HERMES_OUTPUTS[6]).tool_calls
    assert late[0].name == "late_name" and json.loads(late[0].arguments) == {"x": 1}
    assert HermesToolParser().parse(HERMES_OUTPUTS[7]).tool_calls[0].arguments == "{}"
    assert json.loads(HermesToolParser().parse(HERMES_OUTPUTS[8]).tool_calls[0].arguments) == {"q": 1}
    cut = HermesToolParser().parse(HERMES_OUTPUTS[9])  # max_tokens cut the call off: no call (it was '{"city": "Par')
    assert cut.content is None and cut.tool_calls == []
    assert HermesToolParser().parse("").content is None


def test_llama3_json_whole_output():
    one = Llama3JsonToolParser().parse(LLAMA_OUTPUTS[0])
    assert one.content is None and [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    two = Llama3JsonToolParser().parse(LLAMA_OUTPUTS[1])
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [("a", {"x": 1}), ("b", {"y": [2, 3]})]
    for text in LLAMA_OUTPUTS[3:5]:  # prose, or a JSON answer that is not a call: content, as written
        parsed = Llama3JsonToolParser().parse(text)
        assert parsed.content == text and not parsed.tool_calls
    trailing = Llama3JsonToolParser().parse(LLAMA_OUTPUTS[5])
    assert trailing.content == "trailing words" and len(trailing.tool_calls) == 1


def test_outputs_of_the_constrained_choices():
    required = RequiredToolParser().parse(REQUIRED_OUTPUTS[0])
    assert [(c.name, json.loads(c.arguments)) for c in required.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    named = NamedToolParser("get_weather").parse('{"city":"Oslo"}')
    assert named.content is None and [(c.name, c.arguments) for c in named.tool_calls] == \
        [("get_weather", '{"city":"Oslo"}')]


@pytest.mark.parametrize("make, text, num_calls, cut_call", [
    (RequiredToolParser, REQUIRED_OUTPUTS[1], 0, ("get_weather", '{"city":"Par')),
    (RequiredToolParser, '[{"', 0, None),
    (RequiredToolParser, '[{"name":"get_time","parameters":{}},{"name":"get_weather","param', 1, ("get_weather", "")),
    (lambda: NamedToolParser("get_weather"), "{", 0, ("get_weather", "{")),
    (lambda: NamedToolParser("get_weather"), '{"city":"Os', 0, ("get_weather", '{"city":"Os')),
    (Llama3JsonToolParser, LLAMA_OUTPUTS[6], 0, ("cut", '{"x": "unfin')),
    (HermesToolParser, f"<tool_call>{WEATHER}</tool_call><tool_call>" + '{"name": "get_time", "arguments": {', 1,
     ("get_time", "{")),
], ids=["required", "required-start", "required-second", "named-brace", "named", "llama3_json", "hermes-second"])
def test_a_call_cut_off_by_max_tokens_is_no_call(make, text, num_calls, cut_call):
    """As OpenAI and vLLM answer a whole output: the calls before the cut, none with arguments a client cannot parse
    (a named choice cut after "{" came back as arguments "{"). Streamed, the cut call went out as it was written (as
    OpenAI's and vLLM's): the client has it as far as it got, and nothing else: no "{}" that would close it, no
    content."""
    whole = make().parse(text)
    assert len(whole.tool_calls) == num_calls and not whole.content
    for call in whole.tool_calls:
        json.loads(call.arguments)
    for deltas in (list(text), [text]):
        parser = make()
        content, calls = stream(parser, deltas)
        assert content == "" and [(n, a) for _, n, a in calls[:num_calls]] == \
            [(c.name, c.arguments) for c in whole.tool_calls]
        assert [(n, a) for _, n, a in calls[num_calls:]] == ([cut_call] if cut_call else [])
        assert parser.num_calls == num_calls  # what the finish_reason reads


def stream(parser, deltas: list[str]):
    """Feeds the deltas, then finishes; returns (content, calls as [id, name, arguments]) from the chunks, checking
    their shape on the way: a call's first chunk has its id and name, later ones only arguments."""
    content, calls = "", []
    for delta in [parser.feed(d) for d in deltas] + [parser.finish()]:
        content += delta.content
        for chunk in delta.tool_calls:
            if chunk.index == len(calls):
                assert chunk.id and chunk.name, chunk
                calls.append([chunk.id, chunk.name, chunk.arguments])
            else:
                assert chunk.index < len(calls) and chunk.id is None and chunk.name is None, chunk
                calls[chunk.index][2] += chunk.arguments
    return content, calls


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("make, outputs", [(HermesToolParser, HERMES_OUTPUTS), (Llama3JsonToolParser, LLAMA_OUTPUTS),
                                           (RequiredToolParser, REQUIRED_OUTPUTS),
                                           (lambda: NamedToolParser("f"), ['{"a":1}', ""])],
                         ids=["hermes", "llama3_json", "required", "named"])
def test_streams_of_any_split_add_up_to_the_whole_parse(make, outputs):
    """Every split streams the same; that is the whole parse, plus the call an output was cut inside (as far as
    it got: its arguments as written, never whole JSON)."""
    rng = random.Random(0)
    for text in outputs:
        whole = make().parse(text)
        expected = [(c.name, c.arguments) for c in whole.tool_calls]
        splits = [list(text), [text]] + [random_split(text, rng) for _ in range(20)]
        first = None
        for deltas in splits:
            content, calls = stream(make(), deltas)
            calls = [(n, a) for _, n, a in calls]
            assert (content or None) == whole.content, (text, deltas)
            assert calls[:len(expected)] == expected and len(calls) <= len(expected) + 1, (text, deltas)
            assert first in (None, calls), (text, deltas)
            first = calls
        for _, arguments in first[len(expected):]:  # the cut call
            assert arguments in text and not _is_json_object(arguments), text


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_a_call_streams_as_it_is_written():
    """As OpenAI and vLLM stream a call: its id and name once the name is known, then its arguments piece by piece
    (not in one chunk when its object closes); content streams as it is written."""
    parser = HermesToolParser()
    text = f"Hi there <tool_call>{WEATHER}</tool_call>"
    seen = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert [i for i, d in enumerate(seen) if d.content][:2] == [0, 1]  # character by character
    first = next(i for i, d in enumerate(seen) if d.tool_calls)
    assert "".join(d.content for d in seen[:first]) == "Hi there"
    assert seen[first].tool_calls[0].name == "get_weather" and first < text.index('"arguments"')
    args = [d.tool_calls[0].arguments for d in seen[first + 1:] if d.tool_calls]
    assert len(args) > 10  # the arguments went out character by character, not at the end
    assert json.loads(seen[first].tool_calls[0].arguments + "".join(args)) == json.loads(WEATHER)["arguments"]
    for make, output in [(RequiredToolParser, REQUIRED_OUTPUTS[0]), (lambda: NamedToolParser("f"), '{"a": [1, 2]}'),
                         (Llama3JsonToolParser, LLAMA_OUTPUTS[0])]:
        parser = make()
        with_arguments = [d for d in (parser.feed(ch) for ch in output) if any(c.arguments for c in d.tool_calls)]
        assert len(with_arguments) > 5, output


def test_parser_names_and_the_chat_template_choice(tiny_tokenizer):
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="^tool_call_parser must be one of"):
        get_tool_parser("mistral")
    qwen = "{% for tool in tools %}...{% endfor %}<tool_call>\n{\"name\": <function-name>}\n</tool_call>"
    llama = "{{- '<|python_tag|>' }}{%- if message.role == 'ipython' %}{\"name\": ..., \"parameters\": ...}"
    assert tool_parser_for_template(qwen) == "hermes"
    assert tool_parser_for_template(llama) == "llama3_json"
    assert tool_parser_for_template(qwen + llama) is None  # ambiguous: the user must say
    assert tool_parser_for_template(tiny_tokenizer.chat_template) is None
    assert tool_parser_for_template(None) is None


def test_every_prefix_of_a_stream_is_settled_text():
    """Nothing sent is ever taken back: at every prefix, what went out is a prefix of the final result."""
    for text in HERMES_OUTPUTS:
        final = HermesToolParser().parse(text)
        parser, content = HermesToolParser(), ""
        for ch in itertools.chain(text):
            content += parser.feed(ch).content
            assert (final.content or "").startswith(content)
