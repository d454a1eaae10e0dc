"""Apps of their own on the session's cluster (direct mode: HAProxy in front of the ingress replicas, as `pagoda
serve` runs it), each from `pagoda serve` flags or app args:

- what a model admits at once is exact, burst after burst (`--max-num-seqs 4 --max-ongoing-requests 4
  --max-queued-requests 4`: 4 run, 4 wait for a replica, the rest are 429s), and clients that leave, running or
  still waiting for a replica, leave the engine idle with none of their requests run to its end;
- `/metrics` lists a model served under two names once;
- a model redeployed with other limits has them at an ingress that outlived it.
"""

import json
import socket
import threading
import time
import urllib.parse
from collections import Counter

import httpx
import pytest

APP = "pagoda-admission"
BURST = 100
# Longer than any burst takes to be answered (at least this many engine steps), so no admitted request ends and
# frees its slot during one; the clients leave long before.
MAX_TOKENS = 2000


@pytest.fixture(scope="module")
def admission_url(serve_url):
    from ray import serve

    from cluster.app import build_app
    from deploy.cli import build_parser, serve_app_args

    flags = ["serve", "--model", "tiny", "--max-num-seqs", "4", "--max-ongoing-requests", "4", "--max-queued-requests",
             "4", "--num-kv-blocks", "600", "--replica-num-cpus", "0.5", "--served-model-name", "adm", "adm-alias"]
    app_args = serve_app_args(build_parser().parse_args(flags)) | {"debug": True}
    serve.run(build_app(app_args), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


class LeavingClient(threading.Thread):
    """A streamed completion on a connection of its own (its body written 0.2 s after its headers): it notes the
    response's status when one comes and keeps the connection (reading what comes) until `leave` is set, then
    closes it, whatever came by then."""

    def __init__(self, url: str, body: dict, leave: threading.Event):
        super().__init__(daemon=True)
        self.url, self.body, self.leave = urllib.parse.urlparse(url), body, leave
        self.status: int | None = None
        self.got_tokens = False  # an SSE event came (the engine runs its request)
        self.ended = False  # its answer came to its end before the client left

    def run(self) -> None:
        payload = json.dumps(self.body).encode()
        head = (f"POST {self.url.path}/v1/completions HTTP/1.1\r\nHost: {self.url.hostname}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        with socket.create_connection((self.url.hostname, self.url.port)) as sock:
            sock.sendall(head)
            time.sleep(0.2)  # the body apart from the headers, as clients such as httpx write them
            sock.sendall(payload)
            sock.settimeout(0.2)
            first = b""
            while not self.leave.is_set():
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                if self.status is None:
                    first += chunk
                    if b"\r\n" in first:
                        self.status = int(first.split(b" ", 2)[1])
                self.got_tokens = self.got_tokens or b"data: {" in first + chunk
                self.ended = self.ended or b"data: [DONE]" in chunk


def burst(url: str, body: dict, num_answered: int) -> tuple[Counter, int]:
    """BURST clients at once; once num_answered have a status and the admitted have tokens (or a deadline passed),
    all leave. Returns the statuses and how many had none yet. No admitted stream may have ended by then
    (else its slot went to another request): MAX_TOKENS is that long."""
    leave = threading.Event()
    clients = [LeavingClient(url, body, leave) for _ in range(BURST)]
    start = time.monotonic()
    for client in clients:
        client.start()
    deadline = start + 120
    while sum(c.status is not None for c in clients) < num_answered and time.monotonic() < deadline:
        time.sleep(0.1)
    # The admitted leave once tokens reach them, so their requests run in the engine (on a loaded machine their
    # 200s came from the ingress before the replica had added them: they left and the engine never saw them).
    # The engine's stats cannot tell: with every slot taken, the replica's own calls wait for one.
    while (sum(c.got_tokens for c in clients) < sum(c.status == 200 for c in clients)
           and time.monotonic() < deadline):
        time.sleep(0.1)
    statuses = [c.status for c in clients]
    ended = sum(c.ended for c in clients)
    leave.set()
    for client in clients:
        client.join(30)
    assert not ended, f"{ended} admitted streams ended during the burst: it took {time.monotonic() - start:.1f} s"
    return Counter(s for s in statuses if s is not None), statuses.count(None)


def wait_until_idle(http, timeout_s: float = 60) -> Counter:
    """Waits until the engine has no request; its requests finished so far, by reason (of the same poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = http.get("/debug/integrity").json()
        assert report["ok"], report
        stats = [r["stats"] for r in report["models"]["adm"]]
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0 for s in stats):
            return sum((Counter(s["num_finished"] or {}) for s in stats), Counter())
        assert time.monotonic() < deadline, stats
        time.sleep(0.3)


@pytest.mark.timeout(900)
def test_a_burst_is_admitted_exactly_and_clients_that_leave_are_aborted(admission_url):
    """One replica, --max-num-seqs 4, --max-ongoing-requests 4 and --max-queued-requests 4: of 100 streamed
    requests at once, 4 are accepted (their 200 comes), 4 wait in the ingress for a slot, 92 are 429s; the same
    in a second burst, so the first one's slots all came back. Every client leaves while its request runs or
    waits for a replica: afterwards the engine is idle, and no request ran to its end."""
    body = {"model": "adm", "prompt": "Tell me a very long story.", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=admission_url, timeout=60) as http:
        for i in range(2):
            before = wait_until_idle(http)
            statuses, waiting = burst(admission_url, body, num_answered=BURST - 4)
            assert (statuses, waiting) == (Counter({429: BURST - 8, 200: 4}), 4), f"burst {i}: {statuses}, {waiting}"
            after = wait_until_idle(http)
            # the 4 running were aborted (the 4 waiting may never have reached the engine); none ran to its end
            assert after["abort"] - before["abort"] >= 4 and after["length"] == before["length"], (before, after)
        ok = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_metrics_list_a_model_with_aliases_once(admission_url):
    with httpx.Client(base_url=admission_url, timeout=60) as http:
        for model in ("adm", "adm-alias"):
            body = {"model": model, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
        text = http.get("/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert any(line.startswith('pagoda:request_success_total{finished_reason="length",model_name="adm"')
               for line in samples)
    assert len(samples) == len(set(samples)), [s for s, n in Counter(samples).items() if n > 1][:5]
    assert text.count("# TYPE pagoda:request_success_total ") == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_model_redeployed_with_other_limits_has_them_at_the_ingress(serve_url, tiny_tokenizer):
    """The model in an app of its own, the ingress in another, which outlives the model's redeploy: a prompt that
    the first deployment's context cannot hold is refused at the ingress; after the model is redeployed with a
    longer one, the same prompt is served (the ingress kept the first deployment's limits for good)."""
    from ray import serve

    from cluster.app import build_app
    from cluster.ingress import Ingress
    from engine.prompts import longest_token_chars

    model_app, ingress_app = "pagoda-redeployed-model", "pagoda-redeployed-ingress"

    def deploy_model(max_model_len: int) -> None:
        args = {"models": [{"model": "tiny", "served_model_name": "redeployed", "max_model_len": max_model_len,
                            "num_kv_blocks": 256, "replica_num_cpus": 0.5}]}
        serve.run(build_app(args), name=model_app, route_prefix=f"/{model_app}")

    # One character a token for this text (the tiny tokenizer spells it so): beyond 64 tokens' worth of the
    # longest token, within a 2048-token context.
    prompt = "a" * (64 * longest_token_chars(tiny_tokenizer) + 1)
    assert len(tiny_tokenizer.encode(prompt)) < 2000
    body = {"model": "redeployed", "prompt": prompt, "max_tokens": 1}
    try:
        deploy_model(64)
        handle = serve.get_deployment_handle("LLMServer_redeployed", model_app)
        ingress = Ingress.options(ray_actor_options={"num_cpus": 0.1})
        serve.run(ingress.bind({"redeployed": handle}, {"redeployed": {"root": "tiny"}}), name=ingress_app,
                  route_prefix=f"/{ingress_app}")
        with httpx.Client(base_url=f"{serve_url}/{ingress_app}", timeout=60) as http:
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 400 and "characters" in refused.json()["error"]["message"], refused.text
            deploy_model(2048)
            assert http.post("/v1/completions", json={**body, "prompt": "hi"}).status_code == 200
            served = http.post("/v1/completions", json=body)
            assert served.status_code == 200, served.text
    finally:
        serve.delete(ingress_app)
        serve.delete(model_app)
