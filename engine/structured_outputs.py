"""`StructuredOutputsParams`: a constraint on a request's output (vLLM's offline API), validated into an xgrammar
`Grammar` without the tokenizer, so that the HTTP edge can answer 400 before anything reaches the engine.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    kinds: json (a JSON schema, dict or string) | json_object | regex | choice (list of strings) | grammar (EBNF)

JSON is compact by default: no whitespace between tokens (`{"a":1,"b":[2,3]}`), so a model that was never trained
on the schema still reaches its end in a bounded number of tokens; `any_whitespace=True` allows free whitespace
(it is vLLM's `disable_any_whitespace`, inverted). The tokenizer-dependent compilation is engine/grammar.py's.

A constraint is bounded, so that none holds the grammar compiler for long (a 100,000-value enum took 198 s of CPU
against a 128k vocabulary; vLLM sets no bound): its text (MAX_CONSTRAINT_CHARS), the grammar it becomes
(MAX_GRAMMAR_CHARS of xgrammar's EBNF), its enum, const and choice values (MAX_LITERALS, OpenAI's bound) and the
nesting of a schema's subschemas (MAX_SCHEMA_DEPTH). Past one, a ParamError names the field.
"""

from __future__ import annotations

import functools
import json as jsonlib
import re
import threading
from dataclasses import dataclass, field

from engine.errors import ParamError, quoted

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema (as compact JSON), regex, grammar or the choices (as a JSON list)
MAX_GRAMMAR_CHARS = 128 * 1024  # the grammar xgrammar compiles, as EBNF (what the compile time grows with)
MAX_LITERALS = 1000  # a schema's enum and const values, or choices
MAX_SCHEMA_DEPTH = 32  # subschemas within subschemas
_COMPACT_SEPARATORS = (",", ":")
_GRAMMAR_CACHE_SIZE = 256
# xgrammar prefixes its messages with a timestamp and a C++ source location: "[11:30:36] /project/cpp/x.cc:94: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the kinds. Raises ParamError (a ValueError) naming the field ("structured_outputs.regex ...")."""

    json: str | dict | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None  # the output is one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect of GBNF), rule `root`
    json_object: bool = False  # any JSON object
    any_whitespace: bool = False  # json / json_object: allow whitespace between tokens
    key: tuple = field(default=(), init=False, repr=False, compare=False)  # (kind, canonical text, whitespace)

    def __post_init__(self):
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ParamError("structured_outputs", f"must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(kinds) or 'none'}")
        kind = kinds[0]
        if self.any_whitespace and kind not in ("json", "json_object"):
            raise ParamError("structured_outputs.any_whitespace", f"applies to json and json_object, not {kind}")
        if kind == "choice":
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, list) else self.choice)
        object.__setattr__(self, "key", (kind, _canonical_text(self, kind), bool(self.any_whitespace)))
        self.validate()

    @property
    def kind(self) -> str:
        return self.key[0]

    def validate(self) -> None:
        """Builds (once, cached) the grammar: a bad schema, regex or grammar raises ParamError here."""
        grammar_for(self)

    @classmethod
    def from_value(cls, value) -> StructuredOutputsParams:
        """A StructuredOutputsParams, or a dict of its fields (as the HTTP layer has it)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS) - {"any_whitespace"})
            if unknown:
                raise ParamError("structured_outputs", f"has unknown fields {unknown}")
            return cls(**value)
        raise ParamError("structured_outputs",
                         f"must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


def _canonical_text(params: StructuredOutputsParams, kind: str) -> str:
    """The constraint as one string (the cache key). A schema is re-serialized with its keys in their order: the order
    of `properties` is the order in which the output writes them."""
    value = getattr(params, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                raise ParamError("structured_outputs.json", f"is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ParamError("structured_outputs.json", f"must be a JSON schema object, got {type(value).__name__}")
        try:
            return jsonlib.dumps(value, separators=(",", ":"))
        except RecursionError:
            raise ParamError("structured_outputs.json", f"nests subschemas more than {MAX_SCHEMA_DEPTH} deep") from None
        except (TypeError, ValueError) as e:
            raise ParamError("structured_outputs.json", f"is not JSON-serializable: {e}") from None
    if kind == "choice":
        if not isinstance(value, tuple) or not value or not all(isinstance(c, str) and c for c in value):
            raise ParamError("structured_outputs.choice", "must be a non-empty list of non-empty strings")
        return jsonlib.dumps(list(value), ensure_ascii=False)
    if kind == "json_object":
        if value is not True:
            raise ParamError("structured_outputs.json_object", f"must be a boolean, got {quoted(value)}")
        return ""
    if not isinstance(value, str) or not value:
        raise ParamError(f"structured_outputs.{kind}", "must be a non-empty string")
    return value


def import_in_background() -> threading.Thread:
    """Imports xgrammar on a thread of its own (it pulls transformers' modelling code: 2-10 s of CPU), for a process
    whose first constrained request should not wait for it; returns the thread."""
    import importlib

    thread = threading.Thread(target=importlib.import_module, args=("xgrammar",), name="pagoda-xgrammar-import",
                              daemon=True)
    thread.start()
    return thread


def grammar_for(params: StructuredOutputsParams):
    """The xgrammar `Grammar` of a constraint (tokenizer-independent; LRU-cached by the constraint's key). Threads
    that ask for the same constraint at once build it once: the first builds, the others wait and find it cached
    (the ingress validates each request on a thread of its own: a burst of 64 requests with a new schema built it 64
    times, and the burst's first tokens came 0.55 s late on an H200's host). Different constraints build in
    parallel."""
    with _building_guard:
        building = _building.setdefault(params.key, _Building())
        building.num_waiting += 1
    try:
        with building.lock:
            return _grammar(*params.key)
    finally:
        with _building_guard:
            building.num_waiting -= 1
            if not building.num_waiting:
                del _building[params.key]


@dataclass
class _Building:
    """A constraint some thread builds: the lock its builder holds, and how many threads want it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    num_waiting: int = 0


_building_guard = threading.Lock()
_building: dict[tuple, _Building] = {}  # a constraint's key -> its build


@functools.lru_cache(maxsize=_GRAMMAR_CACHE_SIZE)
def _grammar(kind: str, text: str, any_whitespace: bool):
    param = f"structured_outputs.{kind}"
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ParamError(param, f"is {len(text):,} characters long; at most {MAX_CONSTRAINT_CHARS:,} are allowed")
    if kind == "choice" and len(jsonlib.loads(text)) > MAX_LITERALS:
        raise ParamError(param, f"has {len(jsonlib.loads(text)):,} choices; at most {MAX_LITERALS:,} are allowed")
    if kind == "json":
        schema = jsonlib.loads(text)  # as deep as the dict it was dumped from
        _check_schema_bounds(schema)
        _check_schema_support(schema)
    grammar = _build_grammar(kind, text, any_whitespace)
    num_chars = len(str(grammar))
    if num_chars > MAX_GRAMMAR_CHARS:
        raise ParamError(param, f"becomes a grammar of {num_chars:,} characters; at most {MAX_GRAMMAR_CHARS:,} are "
                                "allowed")
    return grammar


def _build_grammar(kind: str, text: str, any_whitespace: bool):
    import xgrammar

    try:
        if kind == "json":
            return _fix_json_strings(xgrammar.Grammar.from_json_schema(text, **_json_options(any_whitespace)))
        if kind == "json_object":  # strict_mode off: any properties (on, {"type": "object"} would allow only {})
            return _fix_json_strings(xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                                       **_json_options(any_whitespace)))
        if kind == "regex":
            return xgrammar.Grammar.from_regex(text)
        if kind == "choice":
            alternatives = " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in jsonlib.loads(text))
            return xgrammar.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgrammar.Grammar.from_ebnf(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with its C++ location in front
        raise ParamError(f"structured_outputs.{kind}", f"is invalid: {xgrammar_message(e)}") from None


# The characters of xgrammar 0.2's JSON strings, fixed in the grammar's text (which xgrammar reads back unchanged):
# its length-bounded strings take control characters, which JSON forbids raw in a string (json.loads rejects them),
# and every string takes the UTF-8 bytes of UTF-16 surrogates (ED A0..BF xx), which are not UTF-8 at all.
_STRING_CHARACTER_FIXES = {
    r'[^\"\\\r\n]': r'[^\0-\x1f\"\\\ud800-\udfff]',  # bounded strings
    r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\\ud800-\udfff]',  # the others
}


def _fix_json_strings(grammar):
    import xgrammar

    text = str(grammar)
    for old, new in _STRING_CHARACTER_FIXES.items():
        text = text.replace(old, new)
    return xgrammar.Grammar.from_ebnf(text)


def _json_options(any_whitespace: bool) -> dict:
    if any_whitespace:
        return {"any_whitespace": True}
    return {"any_whitespace": False, "separators": _COMPACT_SEPARATORS}


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error message, without its timestamp and C++ source location."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0] if lines else type(e).__name__).strip()


# JSON Schema keywords that xgrammar does not enforce: outputs could fail the schema, so a schema using one is an error.
_UNSUPPORTED_KEYWORDS = ("allOf", "not", "if", "then", "else", "contains", "minContains", "maxContains",
                         "dependentRequired", "dependentSchemas", "propertyNames", "unevaluatedProperties",
                         "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_VALUES = ("additionalProperties", "items")  # a subschema (or a list of them: old-style tuple items)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def _check_schema_bounds(schema) -> None:
    """The schema's nesting and its enum and const values, within MAX_SCHEMA_DEPTH and MAX_LITERALS."""
    num_literals, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ParamError("structured_outputs.json", f"nests subschemas more than {MAX_SCHEMA_DEPTH} deep")
        num_literals += len(node["enum"]) if isinstance(node.get("enum"), list) else 0
        num_literals += "const" in node
        if num_literals > MAX_LITERALS:
            raise ParamError("structured_outputs.json", f"has more than {MAX_LITERALS:,} enum and const values")
        stack.extend((child, depth + 1) for child in _children(node))


def _check_schema_support(schema) -> None:
    """What xgrammar would silently ignore, so that outputs could fail the schema, is an error instead."""
    for node in _subschemas(schema):
        if "$ref" in node:
            _resolve_ref(schema, node["$ref"])
        for keyword in _UNSUPPORTED_KEYWORDS:
            if keyword in node:
                raise ParamError("structured_outputs.json", f"uses the keyword {keyword!r}, which is not supported")
        if node.get("uniqueItems") is True:
            raise ParamError("structured_outputs.json", "uses the keyword 'uniqueItems', which is not supported")
        if isinstance(node.get("minProperties"), int) and node["minProperties"] > 1:  # free keys may repeat
            raise ParamError("structured_outputs.json", "has minProperties above 1, which is not supported")
        if isinstance(node.get("pattern"), str) and ("minLength" in node or "maxLength" in node):
            raise ParamError("structured_outputs.json", "has a string with both pattern and minLength/maxLength, which "
                             "is not supported (bound the length in the pattern instead)")


def _resolve_ref(schema: dict, ref):
    """The subschema a `$ref` points at. Only references into the schema itself resolve ('#', '#/$defs/a', any JSON
    pointer): xgrammar leaves a property with any other (`http://...`, `file:///...`) unconstrained."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise ParamError("structured_outputs.json", f"has the $ref {quoted(ref)}: only references into the schema "
                                                    "itself ('#' or '#/...') are supported")
    node = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")  # JSON pointer escapes
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise ParamError("structured_outputs.json", f"has the $ref {quoted(ref)}, which points at nothing in "
                                                        "the schema")
    if not isinstance(node, (dict, bool)):
        raise ParamError("structured_outputs.json", f"has the $ref {quoted(ref)}, which points at no schema")
    return node


def rebase_refs(schema: dict, base: str) -> dict:
    """A copy of `schema` to sit at the JSON pointer `base` ('#/$defs/x') of a larger schema: its references into
    itself ('#', '#/...') are rewritten to point where it now sits."""
    schema = jsonlib.loads(jsonlib.dumps(schema))
    for node in _subschemas(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
    return schema


def _subschemas(node):
    """Every (sub)schema of a schema, following only the keywords that hold subschemas (parents first)."""
    stack = [node] if isinstance(node, dict) else []
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(list(_children(node))))


def _children(node: dict):
    """A schema's direct subschemas (the dicts; a boolean schema has none)."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from (child for child in node[key].values() if isinstance(child, dict))
    for key in _SCHEMA_VALUES + _SCHEMA_LISTS:
        children = node.get(key)
        yield from (child for child in (children if isinstance(children, list) else [children])
                    if isinstance(child, dict))
