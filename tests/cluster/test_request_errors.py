"""A request the engine failed, at the HTTP edge: its RequestError's kind says the status (invalid: a 400 naming the
field, unavailable: a 503 to retry, the engine's fault: a 500), whole or streamed. Through an app of its own whose
engine has a grammar compile timeout of a microsecond (PAGODA_GRAMMAR_COMPILE_TIMEOUT_S in its replica's
environment), so that a constrained request times out in the engine; and `_checked` on hand-made deltas for the
kind no valid request reaches (a grammar xgrammar's compiler refuses: none that passes the edge's checks does)."""

import json
import random
import string
import time

import httpx
import pytest

from cluster import errors
from cluster.request_run import _checked
from engine.request_output import RequestDelta, RequestError, SequenceDelta

APP = "pagoda-compile-timeout"


@pytest.mark.parametrize("error, status, param", [
    (RequestError("structured_outputs.regex did not compile: ...", RequestError.INVALID, "structured_outputs.regex"),
     400, "structured_outputs.regex"),
    (RequestError("the grammar did not compile within 60 s; retry shortly", RequestError.UNAVAILABLE), 503, None),
    (RequestError("RuntimeError: step failed"), 500, None),
])
def test_a_failed_requests_kind_is_its_status(error, status, param):
    done = RequestDelta("r", [SequenceDelta(0, "ab", [1, 2])])
    failed = RequestDelta("r", [SequenceDelta(0, finish_reason="error")], finished=True, error=error)
    assert _checked([done], "r") == [done]
    with pytest.raises(errors.PagodaHTTPError) as e:
        _checked([done, failed], "r")
    assert (e.value.status_code, e.value.param) == (status, param)
    if status < 500:  # the engine's fault stays in the log
        assert e.value.message == error.message
    else:
        assert "RuntimeError" not in e.value.message


@pytest.fixture(scope="module")
def timeout_url(serve_url):
    """The tiny model whose engine gives a grammar a microsecond to compile: a constrained request that is not in its
    compile cache fails, the compilation going on into the cache (a running one cannot be stopped)."""
    from ray import serve

    import cluster.app
    from cluster.app import build_app

    def with_timeout(m, placement):
        options = server_options(m, placement)
        env = {"env_vars": {"PAGODA_GRAMMAR_COMPILE_TIMEOUT_S": "0.000001"}}
        return options | {"ray_actor_options": options["ray_actor_options"] | {"runtime_env": env}}

    server_options = cluster.app._server_options
    cluster.app._server_options = with_timeout  # the one replica option this test adds
    try:
        app = build_app({"models": [{"model": "tiny", "served_model_name": "tiny-timeout", "num_kv_blocks": 64,
                                     "replica_num_cpus": 0.5}]})
    finally:
        cluster.app._server_options = server_options
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


def slow_choices(seed: int) -> list[str]:
    """1,000 choices of 100 letters (within the bounds): about a second of compiling against the tiny vocabulary,
    a million times the timeout; a new list each call, so none is in the compile cache."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters, k=100)) for _ in range(1000)]


@pytest.mark.slow  # 14 s: make test stays under 15 minutes on 2 cores; CI runs it in test-slow
def test_a_grammar_not_compiled_in_time_is_a_503_to_retry(timeout_url):
    """The engine's timeout was a 500 ("the engine failed this request"): it is the server's state, not the
    request's fault, so a 503 whose message says to retry; streamed, the stream's error event says so. A retry of
    the same request passes once the compilation that went on is in the cache; a plain request is served meanwhile."""
    with httpx.Client(base_url=timeout_url, timeout=120) as http:
        body = {"model": "tiny-timeout", "messages": [{"role": "user", "content": "Pick one"}], "max_tokens": 128,
                "guided_choice": slow_choices(0)}
        whole = http.post("/v1/chat/completions", json=body)
        assert whole.status_code == 503, whole.text
        error = whole.json()["error"]
        assert error["type"] == "service_unavailable" and "retry" in error["message"], error
        assert "did not compile within" in error["message"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "guided_choice": slow_choices(1),
                                                              "stream": True}) as streamed:
            events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable", events[-2]
        plain = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "guided_choice"})
        assert plain.status_code == 200, plain.text
        for _ in range(120):  # the compilation runs on (a second or so of CPU); then the retry finds it cached
            retry = http.post("/v1/chat/completions", json=body)
            if retry.status_code != 503:
                break
            time.sleep(1.0)
        assert retry.status_code == 200 and retry.json()["choices"][0]["message"]["content"] in body["guided_choice"]
