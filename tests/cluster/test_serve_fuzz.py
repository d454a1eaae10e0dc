"""Schemathesis against the running app's own /openapi.json: over 1,000 generated requests (valid and invalid)
with every check schemathesis has, plus two of ours: the SSE events a JSON schema cannot describe, and that the
server accepts exactly what the document calls valid. No 5xx, every response as declared, the server alive after.

The document says what the server accepts, the served models' bounds included (cluster/schema_rules.py: token ids
below the vocabulary, tool_choice only with tools, best_of 1 with n 1, ...). Its cross-field conditions multiply
into more branches than schemathesis' generator expands (jsonschema_rs gives up past a few dozen), so requests are
generated from the document without them (`generation_document`) and each is judged by the whole document
(`judged_by`): a request it calls valid gets 2xx, or a 400 only for what no JSON
schema can state (INEXPRESSIBLE: a prompt's length in tokens, a grammar that does not compile, ...); one it calls
invalid gets a 4xx.
"""

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case
from schemathesis.checks import CheckContext
from schemathesis.config import SchemathesisConfig

from cluster.openapi import ROUTES, ErrorResponse
from tests.cluster.conftest import API_KEY

EXAMPLES_PER_OPERATION = 300  # 4 operations with a body (1,200 cases), 4 GETs
MAX_STREAM_EVENTS = 100_000  # more than any generated request streams: a stream's end is the request timeout's
# Tokens a generated case may ask the server to generate (its choices x max_tokens): the schema allows 32 prompts x
# n 32 x 1,023 tokens, minutes of work on a loaded CI machine, and a client timeout must not decide a check (a
# stream of 5 prompts x n 18 with min_tokens was cut short after 5,623 events at 60 s and failed sse_events_conform)
TOKENS_PER_CASE = 1024
# path -> the field that limits its output, and the limit when none is given (chat's: the context's rest)
GENERATING = {"/v1/completions": ("max_tokens", 16), "/v1/chat/completions": ("max_completion_tokens", 1024)}
INPUTS_IN_PARAMETERS = {"/v1/models/{model}", "/tokenizer_info"}  # GETs with something to make invalid
# (param, message) of the 400s that a schema-valid request may get: what a JSON schema cannot state
INEXPRESSIBLE = [
    (r".*", r"maximum context length|this model's context|characters, more than"),  # tokens: the tokenizer's
    (r"min_tokens", r"must be at most max_tokens"),  # one field against another
    (r"(structured_outputs|guided_|response_format|tools).*", r"^(?!only one of)"),  # a constraint that compiles
    (r"tool_choice", r"which is not in tools"),  # a name that must match one in another field
    (r"messages.*", r"chat template|is not JSON|does not appear"),  # what the template makes of the messages
]


def generation_document(document: dict) -> dict:
    """The document less its conditions: the `allOf` entries that are an if/then or an anyOf."""
    loose = copy.deepcopy(document)
    for component in loose["components"]["schemas"].values():
        if "allOf" in component:
            component["allOf"] = [rule for rule in component["allOf"] if not {"if", "anyOf"} & set(rule)]
    return loose


def _count(value) -> int | None:
    """A JSON number that is a whole count (18.0 is one: the server takes it as 18), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value):
        return int(value)
    return None


class Judge:
    """Validates a request body against the whole served document."""

    def __init__(self, document: dict):
        self.document = document
        self.validators = {}

    def is_valid(self, case: Case, body=None) -> bool | None:
        """The case's body (or `body` in its place) by the document; None: nothing in a body to judge (a GET)."""
        body = case.body if body is None else body
        operation = self.document["paths"][case.path][case.method.lower()]
        if "requestBody" not in operation or not isinstance(body, (dict, list)):
            return None
        if case.path not in self.validators:
            schema = operation["requestBody"]["content"]["application/json"]["schema"]
            self.validators[case.path] = jsonschema.Draft202012Validator(
                {**schema, "components": self.document["components"]})
        return self.validators[case.path].is_valid(body)


def within_budget(case: Case, judge: Judge) -> Case:
    """The case with max_tokens, max_completion_tokens and min_tokens lowered (never raised) so that its choices
    generate at most TOKENS_PER_CASE tokens; a case of several choices that gives no limit, whose default would
    pass the budget, gets one. The judge judges the body as sent, and min_tokens is lowered with max_tokens, so a
    pair in order stays in order. A case the document calls invalid that lowering would make valid is left as
    generated: the server refuses it without generating, and schemathesis expects that refusal (a negative case
    whose min_tokens was mutated past its maximum, lowered to the budget, was accepted and failed ST201)."""
    if case.path not in GENERATING or not isinstance(case.body, dict):
        return case
    body = copy.deepcopy(case.body)
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    choices = prompts * max(_count(body.get("n")) or 1, _count(body.get("best_of")) or 1)
    cap = max(1, TOKENS_PER_CASE // choices)
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if (_count(body.get(field)) or 0) > cap:
            body[field] = cap
    limit, default = GENERATING[case.path]
    if all(body.get(field) is None for field in ("max_tokens", "max_completion_tokens")) and \
            choices * default > TOKENS_PER_CASE:
        body[limit] = cap
    if judge.is_valid(case) is False and judge.is_valid(case, body):
        return case
    case.body = body
    return case


def judged_by(judge: Judge):
    def the_server_accepts_what_the_document_does(ctx: CheckContext, response, case: Case):
        """Valid by the whole document: 2xx, or a 400 for one of INEXPRESSIBLE. Invalid: a 4xx."""
        valid = judge.is_valid(case)
        if valid is None or response.status_code in (429, 503):  # nothing to judge; load, not the data
            return
        if not valid:
            assert 400 <= response.status_code < 500, f"accepted a request the document calls invalid: {case.body}"
        elif response.status_code == 400:
            error = json.loads(response.text)["error"]
            assert any(re.fullmatch(param, error["param"] or "") and re.search(message, error["message"])
                       for param, message in INEXPRESSIBLE), f"a request valid by the schema was refused: {error}"

    return the_server_accepts_what_the_document_does


def fuzz_config() -> SchemathesisConfig:
    """400 and 429 stay statuses positive_data_acceptance takes (judged_by tells the right 400s from the wrong);
    every stream is read to its end: schemathesis reads 20 events of one by default, then closes the connection
    and checks what it read, which has no [DONE] (a 10-prompt completion failed sse_events_conform so). Reports
    are not sanitized: schemathesis hides fields whose names hold "token" (max_tokens) as if they were secrets, and a
    failure must show the request as sent (the test's API key is no secret)."""
    return SchemathesisConfig.from_dict({
        "checks": {"positive_data_acceptance": {"expected-statuses": ["2XX", "400", "429"]}},
        "max-stream-events": MAX_STREAM_EVENTS, "output": {"sanitization": {"enabled": False}}})


@schemathesis.check
def sse_events_conform(ctx: CheckContext, response, case: Case):
    """Every `data:` event of a stream is the declared chunk (or, last, an error), and the stream ends [DONE]."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    _, _, _, event_model = ROUTES[case.path]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    # schemathesis stops reading a stream at max-stream-events or when the request's timeout passes: its end unread
    assert not response.stream_cut_short, f"the client stopped reading the stream after {len(events)} events"
    assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: {events[-3:]}"
    for i, event in enumerate(events[:-1]):
        data = json.loads(event)
        if "error" in data:
            assert i == len(events) - 2, "an error event must be the last before [DONE]"
            ErrorResponse.model_validate(data)
        else:
            event_model.model_validate(data)
    return None


@pytest.mark.slow  # 1,200 generated requests: ~50 s on 2 cores
def test_the_api_conforms_to_its_schema(serve_url):
    """Every operation, valid and invalid inputs (half each), EXAMPLES_PER_OPERATION cases, every check (400 and 429
    stay statuses positive_data_acceptance takes: judged_by judges them). (Driven from here, not through
    schemathesis' pytest plugin, whose lazy loading does not work with pytest 9.2.)"""
    from schemathesis.generation import GenerationMode

    document = httpx.get(f"{serve_url}/openapi.json").json()
    judge = Judge(document)
    judged = judged_by(judge)
    schema = schemathesis.openapi.from_dict(generation_document(document), config=fuzz_config())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == set(ROUTES)
    num_cases = 0
    for operation in operations:
        has_input = ROUTES[operation.path][1] is not None or operation.path in INPUTS_IN_PARAMETERS
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
            @given(case=operation.as_strategy(generation_mode=mode).map(
                lambda case: within_budget(case, judge)))
            @settings(max_examples=EXAMPLES_PER_OPERATION // 2, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                nonlocal num_cases
                num_cases += 1
                case.call_and_validate(base_url=serve_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                       timeout=60, additional_checks=[sse_events_conform, judged])

            run()
    assert num_cases >= 1000


def test_the_server_is_alive_and_clean_after_the_fuzzing(http):
    assert http.get("/health").status_code == 200
    report = http.get("/debug/integrity").json()
    assert report["ok"], report
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "still here?", "max_tokens": 3})
    assert r.status_code == 200


def test_a_stream_longer_than_schemathesis_default_is_judged_whole():
    """Schemathesis reads 20 events of a stream by default, then closes the connection (the ingress logs a 499) and
    hands on the first 20: a 10-prompt completion (over 20 events) failed sse_events_conform, no [DONE] in what was
    read. Read the fuzzing's way (its config), a long stream is read to its [DONE]."""
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
             "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}
    events = [f"data: {json.dumps(chunk)}\n\n" for _ in range(50)] + ["data: [DONE]\n\n"]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for event in events:  # one HTTP chunk each, as the ingress streams them
                    data = event.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client left
                pass

        def log_message(self, *args):
            pass

    document = {"openapi": "3.1.0", "info": {"title": "stream", "version": "1"}, "paths": {"/v1/completions": {
        "post": {"requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
                 "responses": {"200": {"description": "events", "content": {"text/event-stream": {}}}}}}}}
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            schema = schemathesis.openapi.from_dict(document, config=fuzz_config())
            case = schema["/v1/completions"]["POST"].Case(body={"stream": True})
            response = case.call(base_url=f"http://127.0.0.1:{server.server_port}", timeout=60)
        finally:
            server.shutdown()
    assert response.status_code == 200
    sse_events_conform(None, response, case)
    assert response.text == "".join(events)


def test_a_generated_case_asks_for_at_most_the_budget():
    """The failing case of a CI run (5 prompts, n 18.0, a large max_tokens and min_tokens) is lowered to the budget
    with min_tokens still at most max_tokens; small cases, GETs and values that are not counts are left as they are."""
    from types import SimpleNamespace

    judge = Judge(_COUNTS_DOCUMENT)
    big = SimpleNamespace(path="/v1/completions", method="POST", body={
        "prompt": ["", "", "a", "b", "c"], "n": 18.0, "max_tokens": 900, "min_tokens": 800, "stream": True})
    body = within_budget(big, judge).body
    assert body["max_tokens"] == body["min_tokens"] == TOKENS_PER_CASE // 90
    assert body["n"] == 18.0 and body["max_tokens"] * 90 <= TOKENS_PER_CASE
    chat = SimpleNamespace(path="/v1/chat/completions", method="POST", body={"messages": [], "n": 8})
    assert within_budget(chat, judge).body["max_completion_tokens"] == TOKENS_PER_CASE // 8
    many = SimpleNamespace(path="/v1/completions", method="POST", body={"prompt": [[1, 2]] * 32, "n": 4})
    assert within_budget(many, judge).body["max_tokens"] == TOKENS_PER_CASE // 128  # 16 tokens each
    for path, body in [("/v1/completions", {"prompt": [1, 2, 3], "n": 2, "max_tokens": 500}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": "many", "min_tokens": True}),
                       ("/v1/chat/completions", {"messages": [], "max_tokens": 1000}),
                       ("/v1/tokenize", {"prompt": "x" * 5000}), ("/v1/models", None)]:
        case = SimpleNamespace(path=path, method="POST" if body else "GET", body=copy.deepcopy(body))
        assert within_budget(case, judge).body == body


def test_a_negative_case_is_not_lowered_into_a_valid_one():
    """CI's failing case: schemathesis mutated a chat request's min_tokens past its maximum (n 10); lowered to the
    budget it became valid, the server served it, and ST201 failed. Left as generated, it stays invalid; a case
    invalid for another reason is still lowered (the server refuses it either way, but it generates nothing)."""
    from types import SimpleNamespace

    judge = Judge(_COUNTS_DOCUMENT)
    mutated = {"messages": [], "n": 10, "min_tokens": 2**31, "max_completion_tokens": 102}
    case = SimpleNamespace(path="/v1/chat/completions", method="POST", body=copy.deepcopy(mutated))
    assert judge.is_valid(case) is False
    assert within_budget(case, judge).body == mutated
    other = {"messages": "not a list", "n": 10, "max_completion_tokens": 900}
    case = SimpleNamespace(path="/v1/chat/completions", method="POST", body=copy.deepcopy(other))
    assert within_budget(case, judge).body == other | {"max_completion_tokens": TOKENS_PER_CASE // 10}


_COUNT = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_COUNTS_DOCUMENT = {  # the served document's counts, as pydantic writes them (the whole one needs a server)
    "components": {"schemas": {"Request": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 128}, "min_tokens": _COUNT, "max_tokens": _COUNT,
        "max_completion_tokens": _COUNT, "messages": {"type": "array"}}}}},
    "paths": {path: {"post": {"requestBody": {"content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Request"}}}}}, "get": {}}
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/models")}}
