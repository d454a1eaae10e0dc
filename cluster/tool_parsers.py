"""Tool calls in a model's output: the parsers `tool_choice="auto"` uses (`--tool-call-parser`, vLLM's names), and
those of the outputs `tool_choice="required"` / a named function constrain (cluster/tool_choice.py). Pure Python.

    hermes       Hermes 2 Pro, Qwen2.5     text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
    llama3_json  Llama 3.1 / 3.2           [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}
    required     tool_choice="required"    [{"name": "f", "parameters": {...}}, ...]
    named        tool_choice={function}    {...}  (the arguments of the one named function)

A parser reads a whole output (`parse`) or its text deltas (`feed`, then `finish`): content deltas and OpenAI's
`delta.tool_calls` chunks (the first of a call has its index, id and name; later ones append to its arguments).
Both read the same: each feed re-reads the output's unsettled tail (the text after the last finished call) and sends
what grew, so the deltas of a stream add up to what `parse` returns (but for a cut call, below). Arguments are the
JSON text as the model wrote it. Content next to a tool call loses the whitespace that touches it; a block that names
no function stays content.

A call streams as it is written, as OpenAI and vLLM stream one: its first chunk once its name is known, then its
arguments piece by piece. A whole output's call is a call once its JSON object closes: one that max_tokens (or a
stop) cut off is no call (the choice ends with finish_reason "length" and the calls before it), as OpenAI and vLLM
answer a whole output. A stream cannot take back what it sent: the client holds the cut call's arguments so far
(as OpenAI's), and nothing more of it goes out. So a stream adds up to the whole parse plus, when the output was
cut inside a call, that call as far as it got (also where a Hermes block closed before its object did: its call
went out before the tag said it would never close).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR = re.compile(r'[^,\]}\s]*')


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallDelta:
    """One entry of a streamed chunk's `delta.tool_calls`."""

    index: int
    id: str | None = None  # the call's first chunk: id and name
    name: str | None = None
    arguments: str = ""  # appended to the call's arguments


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallsDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class _Call:
    name: str | None = None
    arguments: str = ""  # so far
    first_key: str | None = None
    is_complete: bool = False  # its object closed


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the JSON prefix scanner -------------------------------------------------------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class _ValueScanner:
    """Finds where JSON values end in a text that only grows (a stream): the scan of a value resumes where it
    stopped, so a stream is read once, not once per delta. Jumps between the characters that matter."""

    _IN_STRING = re.compile(r'["\\]')
    _OUTSIDE = re.compile(r'["{}\[\]]')

    def __init__(self):
        self._states: dict[int, tuple[int, int, bool]] = {}  # value start -> (position, depth, in a string)
        self._ends: dict[int, int] = {}

    def end(self, text: str, i: int) -> int | None:
        """The end of the JSON value at text[i], or None if the text stops inside it."""
        if i >= len(text):
            return None
        if text[i] != '"' and text[i] not in "{[":
            end = _SCALAR.match(text, i).end()
            return end if end < len(text) else None  # a number may go on
        if i in self._ends:
            return self._ends[i]
        j, depth, in_string = self._states.get(i, (i, 0, False))
        while True:
            match = (self._IN_STRING if in_string else self._OUTSIDE).search(text, j)
            if match is None:
                self._states[i] = (len(text), depth, in_string)
                return None
            j, c = match.start(), match.group()
            if c == "\\":
                if j + 1 >= len(text):  # the escaped character is still to come
                    self._states[i] = (j, depth, in_string)
                    return None
                j += 2
                continue
            j += 1
            if c == '"':
                in_string = not in_string
            else:
                depth += 1 if c in "{[" else -1
            if depth == 0 and not in_string:
                self._ends[i] = j
                return j


def _scan_call(text: str, i: int, values: _ValueScanner) -> tuple[_Call, int | None]:
    """Reads a call object `{"name": ..., "arguments": ...}` at text[i] == "{" as far as the text goes: its end, or
    None while it is open. Arguments that are an object or array grow as they are written; others appear whole."""
    call, j = _Call(), i + 1
    while True:
        j = _skip_ws(text, j)
        if j < len(text) and text[j] == ",":
            j = _skip_ws(text, j + 1)
        if j >= len(text):
            return call, None
        if text[j] == "}":
            call.is_complete = True
            return call, j + 1
        key_end = values.end(text, j) if text[j] == '"' else None
        if key_end is None:
            return call, None
        key = json.loads(text[j:key_end])
        call.first_key = call.first_key or key
        j = _skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return call, None
        start = _skip_ws(text, j + 1)
        end = values.end(text, start)
        if key == "name" and end is not None:
            name = json.loads(text[start:end])
            call.name = name if isinstance(name, str) and name else None
        elif key in _ARGUMENT_KEYS and end is not None:
            raw = text[start:end]
            call.arguments = json.loads(raw) if raw.startswith('"') else raw  # some models write them as a string
        elif key in _ARGUMENT_KEYS and start < len(text) and text[start] in "{[":
            call.arguments = text[start:]
        if end is None:
            return call, None
        j = end


# ---- parsers -----------------------------------------------------------------------------------------------------
class ToolParser:
    """One output's tool calls. `parse(text)` reads a whole output; `feed(delta)` ... `finish()` a stream of it."""

    name = ""

    def __init__(self, make_id=new_call_id):
        self._make_id = make_id
        self._text = ""
        self._values = _ValueScanner()  # the stream's: its text only grows
        self._sent_content = ""
        self._sent_calls: list[tuple[str, int]] = []  # (id, length of the arguments sent)
        self.num_calls = 0  # the output's complete calls, once finished

    def parse(self, text: str) -> ParsedToolCalls:
        content, calls = self._scan_complete(text, True, _ValueScanner())
        return ParsedToolCalls(content or None, [ToolCall(self._make_id(), c.name, c.arguments)
                                                 for c in calls if c.is_complete])

    def feed(self, delta: str) -> ToolCallsDelta:
        self._text += delta
        return self._diff(*self._scan_complete(self._text, False, self._values), final=False)

    def finish(self) -> ToolCallsDelta:
        """The end of the output: what was held back (a possible tag, whitespace) goes out; a call still open was
        cut off and nothing more of it goes out. `num_calls` then counts the output's (complete) calls."""
        content, calls = self._scan_complete(self._text, True, self._values)
        self.num_calls = sum(call.is_complete for call in calls)
        return self._diff(content, calls, final=True)

    def _scan_complete(self, text: str, final: bool, values: _ValueScanner) -> tuple[str, list[_Call]]:
        """_scan's content and calls, each complete call with its arguments ("{}" for a call without)."""
        content, calls = self._scan(text, final, values)
        for call in calls:
            if call.is_complete:
                call.arguments = call.arguments or "{}"  # a call without arguments takes none
        return content, calls

    def _diff(self, content: str, calls: list[_Call], final: bool) -> ToolCallsDelta:
        assert content.startswith(self._sent_content), (self._sent_content, content)
        out = ToolCallsDelta(content[len(self._sent_content):])
        self._sent_content = content
        for index, call in enumerate(calls):
            if final and not call.is_complete:  # cut off: what went out of it stays, nothing more goes
                assert index == len(calls) - 1 or index < len(self._sent_calls), (index, calls)
                continue
            if index == len(self._sent_calls):
                self._sent_calls.append((self._make_id(), len(call.arguments)))
                out.tool_calls.append(ToolCallDelta(index, self._sent_calls[index][0], call.name, call.arguments))
            elif len(call.arguments) > self._sent_calls[index][1]:
                call_id, sent = self._sent_calls[index]
                out.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[sent:]))
                self._sent_calls[index] = (call_id, len(call.arguments))
        return out

    def _scan(self, text: str, final: bool, values: _ValueScanner) -> tuple[str, list[_Call]]:
        """(content, calls with a name) of text; not final: only what no later text can change."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks anywhere in the text (Hermes, Qwen2.5)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _scan(self, text: str, final: bool, values: _ValueScanner) -> tuple[str, list[_Call]]:
        content, calls, pos, after_block = [], [], 0, False
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                content.append(_segment(text[pos:], after_block, self.OPEN, final))
                return "".join(content), calls
            content.append(_segment(text[pos:start], after_block, None, final))
            body = _skip_ws(text, start + len(self.OPEN))
            close = text.find(self.CLOSE, body)
            # An open block is read without a tail that may become its closing tag.
            block = text[:close] if close >= 0 else text[:len(text) - _partial_tag_len(text, self.CLOSE)]
            call, _ = _scan_call(block, body, values) if body < len(block) and block[body] == "{" else (_Call(), None)
            if call.name is not None:
                calls.append(call)
            elif close >= 0 or final:  # no function named: the block is text
                content.append(text[start:close + len(self.CLOSE)] if close >= 0 else text[start:])
            if close < 0:
                return "".join(content), calls
            pos, after_block = close + len(self.CLOSE), True


class _CallSequenceParser(ToolParser):
    """Call objects one after another (`{...}; {...}` or `[{...}, {...}]`); text that is not one is content."""

    prefix, separators = "", ""

    def _scan(self, text: str, final: bool, values: _ValueScanner) -> tuple[str, list[_Call]]:
        i = _skip_ws(text, 0)
        if self.prefix and text.startswith(self.prefix, i):
            i = _skip_ws(text, i + len(self.prefix))
        elif self.prefix and not final and self.prefix.startswith(text[i:]):
            return "", []  # the prefix, or text: what comes tells
        calls = []
        while i < len(text) and text[i] == "{":
            call, end = _scan_call(text, i, values)
            if call.first_key is None or (call.first_key == "name" and call.name is None and end is None):
                if not final:
                    return "", calls  # a call, or a JSON answer: its name will tell
                break
            if call.first_key != "name" or call.name is None:
                break
            calls.append(call)
            if end is None:
                return "", calls
            i = _skip_ws(text, end)
            while i < len(text) and text[i] in self.separators:
                i = _skip_ws(text, i + 1)
        if not calls:  # not a tool call: the output is content, as written
            return (text if final or i < len(text) else ""), []
        return (text[i:] if final else ""), calls


class Llama3JsonToolParser(_CallSequenceParser):
    """`{"name": ..., "parameters": ...}` objects separated by `;`, maybe after `<|python_tag|>` (Llama 3.1)."""

    name = "llama3_json"
    prefix, separators = "<|python_tag|>", ";"


class RequiredToolParser(_CallSequenceParser):
    """The output `tool_choice="required"` constrains: a JSON array of `{"name": ..., "parameters": ...}`. All of
    it is calls: a cut that leaves none (`[{"na`) leaves no content either."""

    name = "required"
    prefix, separators = "[", ",]"

    def _scan(self, text: str, final: bool, values: _ValueScanner) -> tuple[str, list[_Call]]:
        return "", super()._scan(text, final, values)[1]


class NamedToolParser(ToolParser):
    """The output of a named `tool_choice`: the whole text is the arguments of that one function (a call once it is
    one whole JSON value)."""

    def __init__(self, function_name: str, make_id=new_call_id):
        super().__init__(make_id)
        self.name = function_name

    def _scan(self, text: str, final: bool, values: _ValueScanner) -> tuple[str, list[_Call]]:
        if not text and not final:
            return "", []
        end = values.end(text, _skip_ws(text, 0))
        is_complete = (end is not None and not text[end:].strip()) or (final and _is_json(text))  # or a scalar
        return "", [_Call(self.name, text, is_complete=is_complete)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _segment(text: str, after_block: bool, tag: str | None, final: bool) -> str:
    """Content between blocks: stripped where it touches one; while more may come, a tail that may become a
    block's tag (or the whitespace before one) waits."""
    if after_block:
        text = text.lstrip()
    if tag is None:  # a block follows
        return text.rstrip()
    if final:
        return text
    return text[:len(text) - _partial_tag_len(text, tag)].rstrip()


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag (short of the whole tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def get_tool_parser(name: str) -> ToolParser:
    """A new parser by its `--tool-call-parser` name."""
    parsers = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
    if name not in parsers:
        raise ValueError(f"tool_call_parser must be one of {list(parsers)}, got {name!r}")
    return parsers[name]()


def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format implies, when exactly one fits; None when none or both do."""
    if not chat_template:
        return None
    found = []
    if "<tool_call>" in chat_template:
        found.append("hermes")
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        found.append("llama3_json")
    return found[0] if len(found) == 1 else None
