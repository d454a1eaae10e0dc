"""Autoscaling across nodes with Ray's own autoscaler, on one machine: a FakeCluster (its own head, GCS port and
temp dir; worker nodes of type {CPU: 2, model_slot: 1} that the autoscaler adds and removes), driven by
tests/cluster/autoscale_scenario.py in a subprocess (this session has a Ray cluster of its own already).

What it shows, each step bounded by a deadline on a condition, never a fixed sleep: replicas 1 -> 2 under load,
the autoscaler adding a node for each, of the right type; no request failing while scaling up or down; a node
that stops answering: its queued requests retried on the other replica, its streaming ones ended by an error
event then [DONE], noticed within the health-check bound, /health "degraded" (never 503) until its replica is
replaced on a new node; after the load, replicas and nodes back down, the streams of the stopping replica
drained; every engine actor on its replica's node; the ingress on the head.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.serve_env import NODE_HEALTH_ENV
from tests.cluster.autoscale_scenario import MAX_REPLICAS
from tests.cluster.fake_cluster import REPO, FakeCluster, NodeType

SCENARIO_TIMEOUT_S = 600  # the scenario ends when done (4.5-6 min on 2 idle cores); this is for a loaded machine
ENV = {"PAGODA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", **NODE_HEALTH_ENV}
# A node that stops answering is declared dead after failure_threshold health checks that each time out.
NOTICE_BOUND_S = int(NODE_HEALTH_ENV["RAY_health_check_failure_threshold"]) * (
    int(NODE_HEALTH_ENV["RAY_health_check_timeout_ms"]) + int(NODE_HEALTH_ENV["RAY_health_check_period_ms"])) / 1000

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # PAGODA_AUTOSCALE_REPORT=path keeps the report (timeline, every request, every tick) for a person to read.
    output = Path(os.environ.get("PAGODA_AUTOSCALE_REPORT") or tmp_path_factory.mktemp("autoscale") / "report.json")
    cluster = FakeCluster({"CPU": 3, "head": 1}, {"model": NodeType({"CPU": 2, "model_slot": 1}, 0, 3)},
                          idle_timeout_s=6, env=ENV)
    try:
        cluster.start()
        cmd = [sys.executable, "-m", "tests.cluster.autoscale_scenario", "--address", cluster.address,
               "--head-pid", str(cluster.proc.pid), "--deadline-s", str(SCENARIO_TIMEOUT_S - 30),
               "--output", str(output)]
        out = subprocess.run(cmd, cwd=REPO, env=cluster.process_env(), capture_output=True, text=True,
                             timeout=SCENARIO_TIMEOUT_S)
    finally:
        cluster.stop()
    assert out.returncode == 0, out.stderr[-6000:]
    result = json.loads(output.read_text())
    print(json.dumps({"timeline": result["timeline"], "killed": result["killed"]}, indent=1))
    assert result["error"] is None, f"{result['error']}\n{json.dumps(result['timeline'], indent=1)}\n" \
                                    f"{out.stderr[-4000:]}"
    return result


def _records(report, phase):
    return [r for r in report["records"] if r["phase"] == phase]


def _complete(r) -> bool:
    return r["status"] == 200 and r["error"] is None and r["done"] and r["finish_reason"] == "length"


@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 120)
def test_scale_up_adds_a_node_per_replica_and_fails_nothing(report):
    ticks = report["ticks"]
    assert max(t["target"] for t in ticks) == MAX_REPLICAS
    assert any(sum(s == "RUNNING" for s, _ in t["replicas"].values()) == MAX_REPLICAS for t in ticks)
    model_nodes = {node for t in ticks for node in t["model_nodes"]}  # every node of the model type seen alive
    assert report["head_node"] not in model_nodes
    for t in ticks:  # replicas only on nodes of the model type (the autoscaler added them), one per node
        nodes = [node for _, node in t["replicas"].values() if node]
        assert len(nodes) == len(set(nodes)) and set(nodes) <= model_nodes, t
    killed = report["killed"]["replica"]
    failed = [r for r in _records(report, "up") if not _complete(r) and r["replica"] != killed]
    assert not failed, failed[:5]
    assert report["ingress_nodes"] == [report["head_node"]]


def test_engine_actor_always_on_its_replicas_node(report):
    pairs = [(t["replicas"][tag][1], node) for t in report["ticks"] for tag, node in t["engines"].items()
             if t["replicas"].get(tag, ["", ""])[1]]
    assert len({node for _, node in pairs}) >= MAX_REPLICAS + 1, "expected engines on the first, the scaled-up " \
                                                                 "and the replacement nodes"
    assert all(replica_node == engine_node for replica_node, engine_node in pairs), \
        [p for p in pairs if p[0] != p[1]][:5]


def test_lost_node_retries_queued_requests_and_ends_streams_cleanly(report):
    killed = report["killed"]
    assert killed["processes"] > 0 and killed["queued"] > 0 and killed["streaming"] > 0, killed
    assert killed["noticed_after_s"] <= NOTICE_BOUND_S + 10, killed  # the bound, plus a tick of the monitor
    on_node = [r for r in report["records"] if r["replica"] == killed["replica"]
               and (r["end"] is None or r["end"] > killed["at"])]
    retried = [r for r in on_node if r["first_token"] is None or r["first_token"] > killed["at"]]
    cut = [r for r in on_node if r not in retried]
    assert len(retried) == killed["queued"] and all(_complete(r) for r in retried), retried[:5]
    assert len(cut) == killed["streaming"]
    for r in cut:  # output streamed already: no retry can continue it; an error event, then [DONE]
        assert r["error"] and "lost" in r["error"] and r["done"] and r["end"] >= killed["at"], r
    others = [r for r in report["records"] if r["replica"] != killed["replica"] and r["phase"] != "up"]
    assert others and all(_complete(r) for r in others), [r for r in others if not _complete(r)][:5]
    assert "degraded" in killed["health_seen"] and "503" not in killed["health_seen"], killed["health_seen"]
    assert killed["health_after"] == "ok"


def test_scale_down_drains_streams_and_removes_idle_nodes(report):
    down = _records(report, "down")
    assert down and all(_complete(r) for r in down), [r for r in down if not _complete(r)][:5]
    last = report["ticks"][-1]
    assert [s for s, _ in last["replicas"].values()] == ["RUNNING"] and len(last["model_nodes"]) == 1, last
    stopping = {}  # replica -> when it was first seen draining
    for t in report["ticks"]:
        for tag, (state, _) in t["replicas"].items():
            if state == "STOPPING":
                stopping.setdefault(tag, t["t"])
    drained = [r for r in down if r["replica"] in stopping and r["start"] < stopping[r["replica"]] < r["end"]]
    assert drained, f"no stream was in flight on a stopping replica: {stopping}"
