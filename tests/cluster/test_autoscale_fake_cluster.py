"""Autoscaling across nodes with Ray's own autoscaler, on one machine: a FakeCluster (its own head, GCS port and
temp dir, worker nodes of type {CPU: 2, model_slot: 1} that the autoscaler adds and removes), driven by
tests/cluster/autoscale_scenario.py in a subprocess (this session has a Ray cluster of its own already).

What it shows, each step bounded by a deadline on a condition, never a fixed sleep: replicas 1 -> 2 under load
with a node added for each, on the right node type; no request failing while scaling up or down; a killed
node's queued requests retried and its streaming ones ended by an error event then [DONE], its replica
replaced on a new node; replicas and nodes back down after the load, the streams in flight finishing; every
engine actor on its replica's node; the ingress on the head.
"""

import json
import subprocess
import sys

import pytest

from tests.cluster.autoscale_scenario import MAX_REPLICAS, MAX_TOKENS
from tests.cluster.fake_cluster import REPO, FakeCluster, NodeType

SCENARIO_TIMEOUT_S = 480


@pytest.fixture(scope="module")
def report():
    cluster = FakeCluster({"CPU": 3, "head": 1}, {"model": NodeType({"CPU": 2, "model_slot": 1}, 0, 3)},
                          idle_timeout_s=6, env={"PAGODA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
                                                 "TRITON_INTERPRET": "1"})
    cluster.start()
    try:
        cmd = [sys.executable, "-m", "tests.cluster.autoscale_scenario", "--address", cluster.address,
               "--head-pid", str(cluster.proc.pid), "--deadline-s", str(SCENARIO_TIMEOUT_S - 30)]
        out = subprocess.run(cmd, cwd=REPO, env=cluster.process_env(), capture_output=True, text=True,
                             timeout=SCENARIO_TIMEOUT_S)
        print(out.stderr[-6000:])
        assert out.returncode == 0, out.stderr[-6000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        cluster.stop()
    assert result["error"] is None, f"{result['error']}\n{json.dumps(result['timeline'], indent=1)}\n" \
                                    f"{out.stderr[-4000:]}"
    return result


def _records(report, phase):
    return [r for r in report["records"] if r["phase"] == phase]


def _complete(r) -> bool:
    return r["status"] == 200 and r["error"] is None and r["done"] and r["finish_reason"] == "length"


@pytest.mark.slow
@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 120)
def test_scale_up_adds_a_node_per_replica_and_fails_nothing(report):
    ticks = report["ticks"]
    assert max(t["replicas"].get("RUNNING", 0) for t in ticks) == MAX_REPLICAS
    assert max(len(t["model_nodes"]) for t in ticks) >= MAX_REPLICAS
    for t in ticks:  # a replica only ever on a model node, one replica per node, never on the head
        nodes = [pair[0] for pair in t["engines"].values() if pair[0]]
        assert len(nodes) == len(set(nodes)), t
        assert report["head_node"] not in nodes, t
    failed = [r for r in _records(report, "up") if not _complete(r)]
    assert not failed, failed[:5]
    assert report["ingress_nodes"] == [report["head_node"]]


@pytest.mark.slow
def test_engine_actor_always_on_its_replicas_node(report):
    pairs = [pair for t in report["ticks"] for pair in t["engines"].values() if pair[0]]
    assert pairs, "no engine actor was seen"
    assert all(replica_node == engine_node for replica_node, engine_node in pairs), \
        [p for p in pairs if p[0] != p[1]][:5]


@pytest.mark.slow
def test_killed_node_retries_queued_requests_and_ends_streams_cleanly(report):
    killed = report["killed"]
    assert killed["processes"] > 0 and killed["queued"] > 0, killed
    on_killed = [r for r in report["records"] if r["replica"] == killed["replica"] and r["end"] is not None
                 and r["end"] >= killed["at"]]
    retried = [r for r in on_killed if _complete(r)]
    cut = [r for r in on_killed if not _complete(r)]
    assert retried, "no request of the killed replica was retried"
    for r in cut:  # only a request that had streamed output may fail, and then cleanly
        assert r["tokens"] > 0 and r["error"] and r["done"], r
    others = [r for r in report["records"] if r["replica"] != killed["replica"] and r["phase"] != "up"]
    assert all(_complete(r) for r in others), [r for r in others if not _complete(r)][:5]
    assert "503" not in killed["health_seen"], killed["health_seen"]
    assert killed["health_after"] == "ok"


@pytest.mark.slow
def test_scale_down_drains_streams_and_removes_idle_nodes(report):
    down = _records(report, "down")
    assert down and all(_complete(r) for r in down), [r for r in down if not _complete(r)][:5]
    last = report["ticks"][-1]
    assert last["replicas"] == {"RUNNING": 1} and len(last["model_nodes"]) == 1, last
    assert all(r["tokens"] > 0 for r in down if r["finish_reason"] == "length"), MAX_TOKENS
