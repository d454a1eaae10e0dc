"""Faults and abuse over real HTTP (the session app, direct ingress): clients that go away abort their requests,
streaming or not, before they could have finished; abandoned requests do not lock the replica up; a full queue is
a 429 with Retry-After; client-supplied chat templates are refused; a killed engine actor ends its streams with
an error event and [DONE], turns /health to 503 and is replaced."""

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.conftest import API_KEY
from tests.cluster.test_serve_errors import assert_error, sample_value

# Longer than any client here waits for (a few thousand steps of the tiny model).
LONG = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}


def engine_stats(http, model: str) -> list[dict]:
    report = http.get("/debug/integrity").json()
    assert report["ok"], report
    return [r["stats"] for r in report["models"][model]]


def wait_until_idle(http, model: str, timeout_s: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(http, model)
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0 for s in stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.3)


def aborted(http, model: str) -> float:
    return sample_value(http, "pagoda:request_success_total", model_name=model, finished_reason="abort")


def drop_after(serve_url: str, body: dict, seconds: float, path: str = "/v1/completions",
               body_after_s: float = 0.0) -> None:
    """A client that sends a request and closes its connection `seconds` later, whatever came back by then. With
    body_after_s, its body follows its headers that much later, as from clients that write the two apart."""
    import socket
    import urllib.parse

    url = urllib.parse.urlparse(serve_url)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        if body_after_s:
            sock.sendall(head)
            time.sleep(body_after_s)
            sock.sendall(payload)
        else:
            sock.sendall(head + payload)
        time.sleep(seconds)


def test_a_non_streaming_client_that_leaves_aborts_its_request(http, serve_url):
    before_aborted = aborted(http, "tiny-solo")
    before_tokens = sum(s["generation_tokens"] for s in engine_stats(http, "tiny-solo"))
    drop_after(serve_url, {"model": "tiny-solo", **LONG}, 0.5)
    stats = wait_until_idle(http, "tiny-solo")
    assert sum(s["generation_tokens"] for s in stats) - before_tokens < LONG["max_tokens"]  # stopped early
    deadline = time.monotonic() + 20  # the replica's metrics sync every second
    while aborted(http, "tiny-solo") <= before_aborted:
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_abandoned_requests_do_not_lock_the_replica_up(http, serve_url):
    """32 long non-streaming requests, each dropped by its client: afterwards the engine is idle, its blocks are
    free, and new requests are served (the cancelled requests took no one else's messages with them)."""
    with ThreadPoolExecutor(32) as pool:
        for future in [pool.submit(drop_after, serve_url, {"model": "tiny", **LONG, "max_tokens": 480}, 1.0)
                       for _ in range(32)]:
            future.result()
    wait_until_idle(http, "tiny", timeout_s=60)

    def one(i):
        return http.post("/v1/completions", json={"model": "tiny", "prompt": f"after {i}", "max_tokens": 4,
                                                  "ignore_eos": True}).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [200] * 8
    assert http.get("/health").status_code == 200


def test_clients_that_leave_after_sending_their_body_apart_are_aborted(http, serve_url):
    """20 non-streamed requests whose bodies follow their headers by 0.2 s, each client gone 2 s later. HAProxy in
    front spliced such a body, and while it did it passed no client's leaving on: none of them was aborted, each
    ran to its end (deploy/haproxy_bind.py now keeps requests unspliced). Afterwards the engine is idle and none
    finished by length."""
    def finished(stats: list[dict]) -> Counter:  # the engines' own counts, of the same poll as their idleness
        return sum((Counter(s["num_finished"] or {}) for s in stats), Counter())

    before = finished(wait_until_idle(http, "tiny"))
    with ThreadPoolExecutor(20) as pool:
        for future in [pool.submit(drop_after, serve_url, {"model": "tiny", **LONG, "max_tokens": 1000}, 2.0,
                                   body_after_s=0.2) for _ in range(20)]:
            future.result()
    after = finished(wait_until_idle(http, "tiny", timeout_s=60))
    assert after["length"] == before["length"] and after["abort"] > before["abort"], (before, after)


def test_a_full_queue_is_429_with_retry_after(http):
    body = {"model": "tiny-queue", "prompt": "busy", "max_tokens": 200, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: http.post("/v1/completions", json=body), range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert_error(refused, 429, code="rate_limit_exceeded")
    assert int(refused.headers["retry-after"]) >= 1
    wait_until_idle(http, "tiny-queue")


def test_a_batch_larger_than_the_model_admits_at_once_is_400_not_429(http):
    """tiny-queue admits 3 calls at once (one replica, max_ongoing_requests 1, max_queued_requests 2): a batch of 4
    prompts would be refused by Serve on an idle server too, so a 429 that no retry passes; it is a 400 instead."""
    body = {"model": "tiny-queue", "prompt": ["a", "b", "c", "d"], "max_tokens": 2}
    error = assert_error(http.post("/v1/completions", json=body), 400, "prompt")
    assert "4 prompts" in error["error"]["message"] and "admits 3" in error["error"]["message"]
    ok = http.post("/v1/completions", json={**body, "prompt": ["a"]})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize("kwargs, what", [
    ({"chat_template": "{% for i in range(10**5) %}{% for j in range(10**5) %}x{% endfor %}{% endfor %}"},
     "not allowed"),
    ({"add_generation_prompt": True}, "may not set"),
    ({"messages": []}, "may not set"),
    ({"return_assistant_tokens_mask": True}, "may not set"),  # transformers' own argument, not a variable
])
def test_chat_template_kwargs_cannot_run_code_or_collide(http, kwargs, what):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs")
    assert what in error["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_template_variables_named_like_the_renderers_parameters_stay_variables(http, path):
    """chat_template_kwargs {"tokenizer": ...} (schemathesis found it in CI) was passed as a keyword argument to the
    server's own renderer, whose first parameter is `tokenizer`: a TypeError and a 500. Such names are variables of
    the template, as any other."""
    kwargs = {"tokenizer": ["x"], "time_limit_s": None, "template_kwargs": {}, "": {}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs,
            "add_generation_prompt": True} | ({"max_tokens": 2} if path != "/tokenize" else {})
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text


def test_a_request_template_that_runs_too_long_is_stopped():
    """Where an operator allows client templates, rendering has a time limit that stops it (unit level)."""
    from checkpoints.tiny import default_tiny_model_path
    from engine.errors import ParamError
    from engine.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(default_tiny_model_path())
    loop = "{% for i in range(10**5) %}{% for j in range(10**5) %}x{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ParamError, match="limit"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], chat_template=loop, time_limit_s=0.5)
    assert time.monotonic() - start < 30  # stopped, not run to its end (10^10 iterations)


@pytest.mark.slow  # 23 s (a replica replaced): make test stays under 15 minutes; CI runs it in test-slow
def test_a_killed_engine_actor_ends_streams_cleanly_and_is_replaced(http, serve_url):
    import ray

    def engine_actor():
        named = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("EngineCore:") and "tiny-solo" in a["name"]]
        assert len(named) == 1, named
        return ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])

    events, done = [], threading.Event()

    def stream():
        body = {"model": "tiny-solo", **LONG, "stream": True}
        with httpx.Client(base_url=serve_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        done.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(events) < 2:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.05)
    killed_at = time.monotonic()
    ray.kill(engine_actor())
    assert done.wait(30), "the stream did not end"
    ended_s = time.monotonic() - killed_at
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["code"] is None and "pid" not in error["error"]["message"]
    assert ended_s < 10, f"the stream took {ended_s:.1f} s to end"
    deadline = time.monotonic() + 30  # the replica's health check fails within a period or two
    while http.get("/health").status_code == 200:
        assert time.monotonic() < deadline, "/health never reported the dead engine"
        time.sleep(0.2)
    deadline = time.monotonic() + 120  # Serve starts a fresh replica (and engine actor)
    body = {"model": "tiny-solo", "prompt": "back?", "max_tokens": 2}
    while (r := http.post("/v1/completions", json=body)).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(1.0)
    print(f"stream ended {ended_s:.2f} s after the kill; served again {time.monotonic() - killed_at:.1f} s after it")
    assert http.get("/health").status_code == 200
