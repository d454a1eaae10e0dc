"""The running Pagoda app, scraped by a real Prometheus.

The Serve app of cluster.app (tiny model, CPU) serves real OpenAI requests; a real Prometheus (Debian's
`prometheus` package, installed by .ci/run) scrapes the Ray node's metrics export port, as the KubeRay PodMonitor
does; then Prometheus' HTTP API is asked for every metric the Grafana dashboard uses: each must have samples with
the labels the dashboard groups by, and every PromQL expression of the dashboard must return data.
"""

import json
import os
import shutil
import time
import urllib.parse
import urllib.request

import pytest

from tests.deploy.promql import empty_dashboard_queries, query, running_prometheus, scrape_health
from tests.ports import free_port

APP = "pagoda-prometheus"
MODEL = "prom-tiny"
# SmolLM2 with n-gram speculation beside the tiny model: the tiny random model's greedy output never repeats an
# n-gram of its context, so only a real model's copy accepts drafts (the acceptance panels need accepted tokens).
SPEC_MODEL = "prom-smollm2"
MODELS = f"{MODEL}|{SPEC_MODEL}"
ADAPTER = "prom-adapter"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# Serve creates this series at the first exception raised inside a replica; Pagoda's replicas return errors as
# values (the proxy's error counter and pagoda:request_success{finished_reason="error"} count them), so a
# healthy app has no samples of it. The dashboard keeps the panel for crashes.
ONLY_ON_CRASH = {"ray_serve_deployment_error_counter_total"}

if shutil.which("prometheus") is None:
    if os.environ.get("CI"):
        pytest.fail("CI must install Debian's prometheus package (.ci/run does)", pytrace=False)
    pytest.skip("no prometheus binary: `apt-get install prometheus` (CI installs it)", allow_module_level=True)


def _request(url: str, body: dict | None = None, timeout_s: float = 60) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def running_app(ray_cluster, tiny_model_dir, real_model_dir, tmp_path_factory):
    """(base URL of the app, Ray node metrics URL): the real app deployed on the session's Ray cluster."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.app import build_app
    from tests.lora_adapters import make_adapter

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    http_port = _get_global_client().http_config.port  # another test may have started Serve first
    # A small KV pool (12 blocks of 16 tokens) so that concurrent requests preempt each other, and a host KV tier
    # that they resume from (its counters are on the dashboard).
    # LoRA on (an adapter peft wrote; its requests fill the LoRA panels) and n-gram speculation on.
    adapter = make_adapter(tiny_model_dir, str(tmp_path_factory.mktemp("adapter") / ADAPTER))
    app = build_app({"models": [
        {"model": tiny_model_dir, "served_model_name": MODEL, "device": "cpu", "num_kv_blocks": 12,
         "block_size": 16, "max_num_seqs": 8, "replica_num_cpus": 0.5, "num_host_kv_blocks": 64, "enable_lora": True,
         "max_lora_rank": 8, "lora_modules": [{"name": ADAPTER, "path": adapter}], "speculative_config": NGRAM},
        {"model": real_model_dir, "served_model_name": SPEC_MODEL, "device": "cpu", "dtype": "float32",
         "num_kv_blocks": 64, "replica_num_cpus": 0.5, "speculative_config": NGRAM}]})
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    yield f"http://127.0.0.1:{http_port}/{APP}", f"127.0.0.1:{node['MetricsExportPort']}"
    serve.delete(APP)


def _send_traffic(base: str) -> None:
    """Completions and chats, streamed and not, concurrent ones that preempt each other, and one invalid request
    (an error for the error panels)."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # a shared prefix: prefix-cache hits
    long = {"model": MODEL, "max_tokens": 60, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda i: _request(f"{base}/v1/completions", {**long, "prompt": f"{i} {prompt}"})[0],
                              range(4)))
    assert codes == [200] * 4
    assert _request(f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6})[0] == 200
    assert _request(f"{base}/v1/completions", {"model": MODEL, "prompt": prompt + "Hi", "max_tokens": 6,
                                               "stream": True})[0] == 200
    assert _request(f"{base}/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "hi"}]})[0] == 200
    assert _request(f"{base}/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 7})[0] == 400
    assert _request(f"{base}/v1/completions", {"model": ADAPTER, "prompt": prompt, "max_tokens": 6})[0] == 200
    passage = "Copy this line exactly: the cat sat on the mat and the dog lay by the door.\n"
    assert _request(f"{base}/v1/completions", {"model": SPEC_MODEL, "prompt": passage * 2, "max_tokens": 24,
                                               "temperature": 0})[0] == 200


def _ours(name: str) -> str:
    """The series of this app (other tests' apps on the same Ray node export the same names)."""
    return f'{name}{{model_name=~"{MODELS}"}}' if name.startswith("ray_pagoda_") else name


def _series_labels(prometheus: str, name: str) -> list[set[str]]:
    answer = json.loads(_request(f"{prometheus}/api/v1/series?" + urllib.parse.urlencode({"match[]": name}))[1])
    return [set(series) for series in answer.get("data", [])]


@pytest.fixture(scope="module")
def prometheus(running_app, tmp_path_factory):
    """A real Prometheus on loopback scraping the Ray node; its HTTP API's base URL."""
    with running_prometheus(running_app[1], tmp_path_factory.mktemp("prometheus")) as base:
        yield base


@pytest.mark.slow
def test_prometheus_scrapes_every_dashboard_metric_from_the_running_app(running_app, prometheus, known_metrics,
                                                                          repo):
    base, _ = running_app
    deadline = time.monotonic() + 120
    wanted = set(known_metrics) - ONLY_ON_CRASH
    missing, errors = wanted, []
    bad_request = 'ray_serve_num_http_requests_total{status_code="400"}'
    while (missing or not errors) and time.monotonic() < deadline:  # Ray exports every few seconds; rate()
        _send_traffic(base)  # needs two scrapes
        time.sleep(3)
        try:
            missing = {name for name in wanted if not query(prometheus, _ours(name))["data"]["result"]}
            errors = query(prometheus, bad_request)["data"]["result"]
        except OSError:
            continue  # Prometheus still starting
    assert not missing, f"Prometheus has no samples of: {sorted(missing)}"
    assert errors, "the invalid request is not counted as a 400"

    engine_labels = {"model_name", "replica"}
    for name in known_metrics:
        if name.startswith("ray_pagoda_"):
            labels = _series_labels(prometheus, name)
            assert any(engine_labels <= s for s in labels), f"{name}: labels {labels}"
    ours = query(prometheus, f'ray_pagoda_prompt_tokens_total{{model_name="{MODEL}"}}')["data"]["result"]
    assert ours and all(series["metric"]["replica"] for series in ours)  # other tests' apps may report too
    success = _series_labels(prometheus, "ray_pagoda_request_success_total")
    assert any("finished_reason" in s for s in success)

    for _ in range(3):
        _send_traffic(base)
        time.sleep(2)
    # Until every dashboard query has data, or a minute (Ray exports every few seconds)
    deadline = time.monotonic() + 60
    while (empty := empty_dashboard_queries(prometheus, repo, MODELS, ONLY_ON_CRASH)) and time.monotonic() < deadline:
        _send_traffic(base)
        time.sleep(2)
    assert not empty, "dashboard queries with no data:\n" + "\n".join(empty) + "\n" + scrape_health(prometheus)
