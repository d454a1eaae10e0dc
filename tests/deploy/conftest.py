"""Shared by tests/deploy: the repository's paths, KubeRay's CRD schemas, and Pagoda's metric names.

Pagoda's engine metrics are defined with vLLM-like names (`pagoda:prompt_tokens`) and recorded through
`ray.util.metrics`. Ray 2.60 exports them (test_deploy_metrics_export.py proves it) as:

    pagoda:prompt_tokens (counter)   recorded as pagoda_prompt_tokens  ->  ray_pagoda_prompt_tokens_total
    pagoda:kv_cache_usage_perc       (gauge)                           ->  ray_pagoda_kv_cache_usage_perc
    pagoda:..._seconds (histogram)                                     ->  ray_pagoda_..._seconds_bucket/_sum/_count

A name that still holds ':' is dropped by Ray's exporter without an error, hence the '_'.
"""

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

ENGINE_METRICS = {
    "pagoda:num_requests_running": "gauge",
    "pagoda:num_requests_waiting": "gauge",
    "pagoda:kv_cache_usage_perc": "gauge",
    "pagoda:prefix_cache_queries": "counter",
    "pagoda:prefix_cache_hits": "counter",
    "pagoda:host_prefix_cache_queries": "counter",
    "pagoda:host_prefix_cache_hits": "counter",
    "pagoda:kv_offloaded_bytes": "counter",
    "pagoda:kv_onloaded_bytes": "counter",
    "pagoda:host_kv_cache_usage_perc": "gauge",
    "pagoda:num_preemptions": "counter",
    "pagoda:swapped_out_tokens": "counter",
    "pagoda:swapped_in_tokens": "counter",
    "pagoda:preemption_recomputed_tokens": "counter",
    "pagoda:spec_decode_num_drafts": "counter",
    "pagoda:spec_decode_num_draft_tokens": "counter",
    "pagoda:spec_decode_num_accepted_tokens": "counter",
    "pagoda:spec_decode_num_accepted_tokens_per_pos": "counter",
    "pagoda:prompt_tokens": "counter",
    "pagoda:generation_tokens": "counter",
    "pagoda:request_success": "counter",
    "pagoda:time_to_first_token_seconds": "histogram",
    "pagoda:inter_token_latency_seconds": "histogram",
    "pagoda:e2e_request_latency_seconds": "histogram",
    "pagoda:request_queue_time_seconds": "histogram",
    "pagoda:request_prefill_time_seconds": "histogram",
    "pagoda:request_decode_time_seconds": "histogram",
    "pagoda:request_time_per_output_token_seconds": "histogram",
    "pagoda:request_prompt_tokens": "histogram",
    "pagoda:request_generation_tokens": "histogram",
    "pagoda:iteration_tokens_total": "histogram",
    "pagoda:gpu_memory_used_bytes": "gauge",
    "pagoda:gpu_utilization_perc": "gauge",
    "pagoda:lora_requests_info": "gauge",
    "pagoda:lora_request_success": "counter",
}

# Ray Serve's own metrics that the dashboard reads, each seen in a scrape of Ray 2.60.
SERVE_METRICS = {
    "ray_serve_num_http_requests_total",
    "ray_serve_num_http_error_requests_total",
    "ray_serve_deployment_error_counter_total",
    "ray_serve_deployment_replica_healthy",
    "ray_serve_autoscaling_target_replicas",
    "ray_serve_deployment_status",
}


def exported_names(name: str, kind: str) -> list[str]:
    """The sample names Prometheus scrapes for a metric that Pagoda defines as `name`."""
    base = "ray_" + name.replace(":", "_")
    if kind == "counter":
        return [base if base.endswith("_total") else base + "_total"]
    if kind == "histogram":
        return [base + "_bucket", base + "_sum", base + "_count"]
    return [base]


def known_metric_names() -> set[str]:
    names = set(SERVE_METRICS)
    for name, kind in ENGINE_METRICS.items():
        names.update(exported_names(name, kind))
    return names


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def kuberay_schemas() -> dict[str, dict]:
    """The `v1` openAPIV3Schema of each KubeRay CRD, by kind: {"RayService": {...}, "RayCluster": {...}}.

    They are vendored in k8s/crds/ (k8s/crds/SOURCE.md names the KubeRay commit they come from).
    """
    folder = REPO / "k8s" / "crds"
    schemas = {}
    for path in sorted(folder.glob("ray.io_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schemas[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    missing = {"RayService", "RayCluster"} - schemas.keys()
    if missing:
        pytest.fail(f"no CRD schema for {sorted(missing)} in {folder}")
    return schemas


@pytest.fixture(scope="session")
def engine_metrics() -> dict[str, str]:
    """Pagoda's engine metrics as defined (name -> kind)."""
    return dict(ENGINE_METRICS)


@pytest.fixture(scope="session")
def known_metrics() -> set[str]:
    """Every sample name the dashboard may read: the engine metrics as Ray exports them, and SERVE_METRICS."""
    return known_metric_names()


@pytest.fixture(scope="session")
def to_exported():
    """`exported_names` as a fixture: (name, kind) -> the sample names Prometheus scrapes."""
    return exported_names
