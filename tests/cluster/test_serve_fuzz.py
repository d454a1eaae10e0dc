"""Schemathesis against the running app's own /openapi.json: over 1,000 generated requests (valid and invalid)
with every check schemathesis has, plus one of ours for the SSE events a JSON schema cannot describe; no 5xx, every
response as declared, and the server alive afterwards.

`positive_data_acceptance` expects 2xx for schema-valid data; a request can be valid by the schema and still
exceed the model's limits (its context length, its vocabulary), which only the served model knows: those are
400s, named in the error, so 400 is an accepted answer to valid data too.
"""

import json

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case
from schemathesis.checks import CheckContext
from schemathesis.config import SchemathesisConfig

from cluster.openapi import ROUTES, ErrorResponse
from tests.cluster.conftest import API_KEY

EXAMPLES_PER_OPERATION = 300  # 4 operations with a body (1,200 cases), 2 GETs without parameters


@schemathesis.check
def sse_events_conform(ctx: CheckContext, response, case: Case):
    """Every `data:` event of a stream is the declared chunk (or, last, an error), and the stream ends [DONE]."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    _, _, _, event_model = ROUTES[case.path]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: {events[-3:]}"
    for i, event in enumerate(events[:-1]):
        data = json.loads(event)
        if "error" in data:
            assert i == len(events) - 2, "an error event must be the last before [DONE]"
            ErrorResponse.model_validate(data)
        else:
            event_model.model_validate(data)
    return None


def test_the_api_conforms_to_its_schema(serve_url):
    """Every operation, valid and invalid inputs (half each), EXAMPLES_PER_OPERATION cases. (Driven from here, not
    through schemathesis' pytest plugin, whose lazy loading does not work with pytest 9.2.)"""
    from schemathesis.generation import GenerationMode

    config = SchemathesisConfig.from_dict({"checks": {"positive_data_acceptance": {
        "expected-statuses": ["2XX", "400"]}}})
    schema = schemathesis.openapi.from_url(f"{serve_url}/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == set(ROUTES)
    num_cases = 0
    for operation in operations:
        has_body = ROUTES[operation.path][1] is not None  # nothing to make invalid in a GET without parameters
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_OPERATION // 2, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                nonlocal num_cases
                num_cases += 1
                case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                                       additional_checks=[sse_events_conform])

            run()
    assert num_cases >= 1000


def test_the_server_is_alive_and_clean_after_the_fuzzing(http):
    assert http.get("/health").status_code == 200
    report = http.get("/debug/integrity").json()
    assert report["ok"], report
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "still here?", "max_tokens": 3})
    assert r.status_code == 200
