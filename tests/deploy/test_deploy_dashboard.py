"""deploy/grafana/: the dashboard's structure and PromQL, and the provisioning files.

Whether the PromQL finds Ray's real series is proven in test_deploy_metrics_export.py; here every metric
name it reads must be one that Ray exports for Pagoda (see conftest.py) or one of Ray Serve's.
"""

import json
import re

import pytest
import yaml

# PromQL words that are not metric names.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "rate", "irate", "increase", "histogram_quantile",
    "and", "or", "unless", "on", "ignoring", "group_left", "group_right", "bool", "offset", "clamp_min", "clamp_max",
}


@pytest.fixture(scope="module")
def dashboard(repo):
    return json.loads((repo / "deploy" / "grafana" / "pagoda.json").read_text())


def _panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(dashboard):
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: what is left without strings, label sets, ranges and words."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return words - PROMQL_WORDS


def test_metric_names_helper():
    expr = 'histogram_quantile(0.9, sum by (le, model_name) (rate(ray_pagoda_x_bucket{model_name=~"$m"}[5m])))'
    assert metric_names(expr) == {"ray_pagoda_x_bucket"}


def test_identity(dashboard):
    assert dashboard["uid"] == "pagoda-overview"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"] == "Pagoda"


def test_template_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    assert model["definition"] == "label_values(ray_pagoda_num_requests_running, model_name)"


def test_every_panel_has_a_datasource_and_targets(dashboard):
    panels = _panels(dashboard)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24


def test_no_two_panels_overlap(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        for y in range(grid["y"], grid["y"] + grid["h"]):
            for x in range(grid["x"], grid["x"] + grid["w"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[x, y]!r}"
                cells[x, y] = panel["title"]


def test_promql_reads_only_known_metrics(dashboard, known_metrics):
    for expr in _exprs(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= known_metrics, f"unknown metric {names - known_metrics} in {expr}"


def test_dashboard_shows_every_engine_metric(dashboard, engine_metrics, to_exported):
    used = set().union(*(metric_names(e) for e in _exprs(dashboard)))
    for name, kind in engine_metrics.items():
        assert set(to_exported(name, kind)) & used, f"{name} is on no panel"


def test_engine_panels_filter_on_the_model_variable(dashboard):
    for expr in _exprs(dashboard):
        if "ray_pagoda_" in expr:
            for selector in re.findall(r"ray_pagoda_\w+(\{[^}]*\})?", expr):
                assert selector == '{model_name=~"$model_name"}', expr


def test_latency_quantiles(dashboard):
    quantile_exprs = [e for e in _exprs(dashboard) if e.startswith("histogram_quantile")]
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        exprs = [e for e in quantile_exprs if f"ray_pagoda_{metric}_bucket" in e]
        assert sorted(e.split(",")[0] for e in exprs) == [
            "histogram_quantile(0.5", "histogram_quantile(0.9", "histogram_quantile(0.99"], metric
        for expr in exprs:
            assert re.search(r"sum by \(le, model_name\) \(rate\(ray_pagoda_\w+_bucket\{[^}]*\}\[5m\]\)\)", expr)


def test_serve_request_panels_leave_out_probe_routes(dashboard):
    """Kubernetes probes /-/healthz every few seconds, and a draining proxy answers them with 503."""
    for expr in _exprs(dashboard):
        if "ray_serve_num_http" in expr:
            assert 'route!~"/-/.*"' in expr, expr


def test_dashboards_provider(repo):
    config = yaml.safe_load((repo / "deploy" / "grafana" / "provisioning" / "dashboards.yaml").read_text())
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def test_datasource_provisioning(repo):
    config = yaml.safe_load((repo / "deploy" / "grafana" / "provisioning" / "datasources.yaml").read_text())
    assert config["apiVersion"] == 1
    (source,) = config["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")


def test_cluster_metrics_define_the_names_the_dashboard_reads(engine_metrics, to_exported, known_metrics):
    """cluster/metrics.py (when present) defines the same metrics, under names Ray exports as the dashboard expects."""
    metrics = pytest.importorskip("cluster.metrics")
    defined = {name: spec[0] for name, spec in metrics.METRICS.items()}
    assert defined == engine_metrics
    for name, kind in defined.items():
        recorded = metrics.ray_metric_name(name)
        assert ":" not in recorded, "Ray 2.60 drops metrics whose name holds ':'"
        assert set(to_exported(recorded, kind)) <= known_metrics
