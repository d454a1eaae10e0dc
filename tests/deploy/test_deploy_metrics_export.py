"""What Ray 2.60 really exports for Pagoda's metrics, and whether the dashboard's PromQL finds it.

A Serve deployment records every engine metric through cluster/metrics.py's `ReplicaMetrics` (the replicas'
own code) and answers HTTP through Serve's proxy; the test scrapes the Ray node's metrics export port, where
Prometheus would. A real Prometheus, where one is installed (it is not a project dependency), then runs
every query of the dashboard against that node.
"""

import shutil
import time
import urllib.error
import urllib.request

import pytest

from tests.deploy.promql import empty_dashboard_queries, query, running_prometheus, scrape_health
from tests.ports import free_port

PROBE_APP = "pagoda-metrics-probe"
MODEL = "probe-model"
RAY_LABELS = {"WorkerId", "SessionName", "NodeAddress", "Component", "Version"}


def _get(url: str, timeout_s: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _probe_deployment():
    """A Serve deployment (defined here so that Ray pickles it by value) that records every engine metric."""
    from ray import serve

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class MetricsProbe:
        def __init__(self):
            from ray.util import metrics

            from cluster.metrics import ReplicaMetrics

            self.metrics = ReplicaMetrics(MODEL, "probe-r0")
            self.num_tokens = 0
            # Kept with its ':' on purpose: Ray 2.60 drops such a metric (the test checks it never shows).
            self.colon = metrics.Counter("pagoda:colon_probe", "probe", tag_keys=("model_name",))

        async def __call__(self, request):
            from engine.llm_engine import EngineStats
            from engine.request_output import RequestMetrics

            if request.query_params.get("fail"):
                raise ValueError("probe failure")
            self.num_tokens += 8
            n = self.num_tokens
            self.metrics.sync_engine_stats(EngineStats(
                num_running=2, num_waiting=1, kv_cache_usage=0.5, num_kv_blocks=64, prefix_cache_queries=n,
                prefix_cache_hits=n // 2, num_preemptions=n // 8, prompt_tokens=n, generation_tokens=n // 2,
                device_memory_used_bytes=1 << 30, device_utilization=0.5, host_prefix_cache_queries=n,
                host_prefix_cache_hits=n // 4, kv_offloaded_bytes=n << 20, kv_onloaded_bytes=n << 19,
                host_kv_cache_usage=0.25, swapped_out_tokens=n // 2, swapped_in_tokens=n // 4,
                preemption_recomputed_tokens=n // 8, spec_decode_num_drafts=n // 8,
                spec_decode_num_draft_tokens=n // 2, spec_decode_num_accepted_tokens=n // 4,
                spec_decode_num_accepted_tokens_per_pos=[n // 8, n // 8],
                running_lora_adapters=("sql",), waiting_lora_adapters=("chat",), max_loras=2))
            self.metrics.observe_first_token(0.05)
            self.metrics.observe_inter_token(0.02)
            self.metrics.observe_finished("stop", 0.5, RequestMetrics(10.0, 10.1, 10.2, 10.5, 8, 4), "sql")
            self.metrics.observe_steps([8, 64])
            self.colon.inc(1, tags={"model_name": MODEL})
            return "ok"

    return MetricsProbe


@pytest.fixture(scope="module")
def probe(ray_cluster):
    """(metrics export URL, send_traffic) for a Ray node that runs the probe app behind Serve's HTTP proxy."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    pytest.importorskip("cluster.metrics")
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    http_port = _get_global_client().http_config.port  # another test may have started Serve first
    serve.run(_probe_deployment().bind(), name=PROBE_APP, route_prefix=f"/{PROBE_APP}")
    base = f"http://127.0.0.1:{http_port}"

    def send_traffic():
        for suffix in ("", "", "?fail=1"):
            _get(f"{base}/{PROBE_APP}{suffix}")
        _get(f"{base}/-/healthz")

    send_traffic()
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    yield f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", send_traffic
    serve.delete(PROBE_APP)


def _samples(text: str) -> dict[str, list[set[str]]]:
    """Sample name -> the label-name sets of its series, from Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(set(sample.labels))
    return samples


def _scrape_until(url, names, send_traffic, timeout_s=90):
    """Scrape until every sample name in `names` is there (Ray exports every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _samples(_get(url)[1])
        missing = names - samples.keys()
        if not missing or time.monotonic() > deadline:
            return samples, missing
        send_traffic()
        time.sleep(2)


@pytest.mark.slow  # 26 s of make test's serial Ray phase (its probe app, the export's flush): CI's slow suite
def test_ray_exports_pagoda_metrics_under_the_dashboards_names(probe, known_metrics):
    url, send_traffic = probe
    samples, missing = _scrape_until(url, known_metrics, send_traffic)
    assert not missing, f"not exported by Ray: {sorted(missing)}"

    # Ray adds 'ray_' and, for counters, '_total'; it keeps our tags and adds its own.
    (labels, *_) = [s for s in samples["ray_pagoda_prompt_tokens_total"]]
    assert {"model_name", "replica"} | RAY_LABELS <= labels
    assert any({"model_name", "replica"} <= s for s in samples["ray_pagoda_kv_cache_usage_perc"])
    assert any("finished_reason" in s for s in samples["ray_pagoda_request_success_total"])
    assert any("le" in s for s in samples["ray_pagoda_time_to_first_token_seconds_bucket"])
    assert any({"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= s
               for s in samples["ray_pagoda_lora_requests_info"])
    assert any({"lora_name", "finished_reason"} <= s for s in samples["ray_pagoda_lora_request_success_total"])
    assert not any("colon_probe" in name for name in samples), "Ray exported a metric named with ':'"

    # Serve's request metrics carry the labels the dashboard groups and filters by.
    assert any({"application", "route", "status_code"} <= s for s in samples["ray_serve_num_http_requests_total"])
    assert any({"route", "error_code"} <= s for s in samples["ray_serve_num_http_error_requests_total"])
    assert any({"deployment", "replica"} <= s for s in samples["ray_serve_deployment_replica_healthy"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (not a project dependency)")
def test_dashboard_queries_find_series_in_prometheus(probe, known_metrics, repo, tmp_path):
    url, send_traffic = probe
    samples, missing = _scrape_until(url, known_metrics, send_traffic)
    assert not missing, f"not exported by Ray: {sorted(missing)}"
    target = url.removeprefix("http://").removesuffix("/metrics")
    with running_prometheus(target, tmp_path) as base:
        deadline = time.monotonic() + 60
        while True:  # rate() needs two scrapes that saw the counter
            send_traffic()
            time.sleep(2)
            try:
                ready = query(base, "count_over_time(ray_pagoda_prompt_tokens_total[1m])")
            except OSError:
                continue
            values = [float(r["value"][1]) for r in ready.get("data", {}).get("result", [])]
            if (values and min(values) >= 3) or time.monotonic() > deadline:
                break
        empty = empty_dashboard_queries(base, repo, MODEL)
        assert not empty, "queries with no series:\n" + "\n".join(empty) + "\n" + scrape_health(base)
