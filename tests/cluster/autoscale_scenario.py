"""The autoscaling scenario, as a driver of a FakeCluster (tests/cluster/fake_cluster.py); writes a JSON report.

    python -m tests.cluster.autoscale_scenario --address HOST:PORT --head-pid PID --output report.json

    deploy   the tiny model: replicas on `model` nodes ({model_slot: 1}), the ingress on the head ({head: 1}),
             1..MAX replicas under Pagoda's policy; the first replica makes the autoscaler add the first node
    up       streams until MAX replicas run, each on a node of its own that the autoscaler added
    kill     one replica's node stops answering (SIGSTOP) while it has requests queued and streaming; once the
             cluster has declared it dead its processes are killed, and its replica is replaced on a new node
    down     long streams start (one replica's worth), then the load stops: a replica drains its long streams
             and stops, the idle node goes

A monitor thread records, every tick: replicas by state, the model nodes alive, where every engine actor runs
against its replica. Every HTTP request is recorded (replica, tokens received, how it ended). The test
(test_autoscale_fake_cluster.py) asserts on the report; PAGODA_AUTOSCALE_REPORT=path keeps it for a person.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

APP, DEPLOYMENT = "pagoda", "LLMServer_tiny"
MAX_REPLICAS = 2
MAX_TOKENS = 48
LONG_MAX_TOKENS = 160  # streams back to back: some are in flight when a replica starts to drain
MAX_NUM_SEQS = 4  # per replica: more requests wait in its engine
# The policy scales on ongoing requests here (its waiting-requests signal is set out of reach): the 24 short streams
# ask for 3 replicas (2 at most), the drain phase's LONG_STREAMS for one.
TARGET_ONGOING = 10
LONG_STREAMS = TARGET_ONGOING


@dataclass
class Record:
    """One streamed completion as its client saw it."""

    phase: str
    start: float
    replica: str = ""
    status: int = 0
    tokens: int = 0  # content chunks received
    first_token: float | None = None
    end: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # an error event in the stream, or a failed request
    done: bool = False  # [DONE] received


@dataclass
class Tick:
    t: float
    status: str  # the deployment's status in Serve (HEALTHY, UPSCALING, UNHEALTHY, ...)
    target: int  # Serve's target number of replicas
    replicas: dict[str, list[str]]  # replica tag -> [state, its node]
    engines: dict[str, str]  # replica tag -> the node of its engine actor
    model_nodes: list[str]  # alive nodes with model_slot (fake node ids)

    def num(self, state: str) -> int:
        return sum(s == state for s, _ in self.replicas.values())


@dataclass
class Report:
    timeline: dict[str, float] = field(default_factory=dict)  # event -> seconds since the start
    ticks: list[Tick] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    killed: dict = field(default_factory=dict)
    head_node: str = ""
    ingress_nodes: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)  # Serve's recent autoscaling decisions


class Scenario:
    def __init__(self, address: str, head_pid: int, streams: int, deadline_s: float):
        self.address, self.head_pid, self.streams = address, head_pid, streams
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.report = Report()
        self.phase = "up"
        self.url = ""
        self._stop_monitor = threading.Event()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def mark(self, event: str) -> None:
        self.report.timeline[event] = self.now()
        print(f"[{self.now():7.1f}s] {event}", file=sys.stderr, flush=True)

    # ---- the cluster's state ---------------------------------------------------------------------------------------
    def deploy(self) -> None:
        import ray
        from ray import serve

        from cluster.app import build_app
        from tests.ports import free_port

        ray.init(address=self.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        self.url = f"http://127.0.0.1:{port}"
        self.mark("serve_started")
        app = build_app({
            "models": [{"served_model_name": "tiny", "max_model_len": 2048, "num_kv_blocks": 2048,
                        "max_num_seqs": MAX_NUM_SEQS, "replica_num_cpus": 1, "replica_resources": {"model_slot": 1},
                        "health_check_period_s": 2, "graceful_shutdown_timeout_s": 300,  # drain: slow machines too
                        "autoscaling_config": {"min_replicas": 1, "max_replicas": MAX_REPLICAS,
                                               "target_ongoing_requests": TARGET_ONGOING, "policy": "pagoda",
                                               "target_waiting_requests": 1000,
                                               "upscale_delay_s": 1,
                                               "downscale_delay_s": 6, "metrics_interval_s": 0.5,
                                               "look_back_period_s": 2}}],
            "ingress_resources": {"head": 1}, "accept_timeout_s": 300})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        threading.Thread(target=self._monitor, daemon=True).start()
        self.wait("first replica running", lambda: self.running() == 1)

    def running(self) -> int:
        return self.report.ticks[-1].num("RUNNING") if self.report.ticks else 0

    def _monitor(self) -> None:
        import ray
        from ray._private import state
        from ray.serve.context import _get_global_client

        controller = _get_global_client()._controller
        while not self._stop_monitor.wait(0.5):
            try:
                details = ray.get(controller.get_serve_instance_details.remote(), timeout=30)
                deployment = details["applications"][APP]["deployments"][DEPLOYMENT]
                ingress = details["applications"][APP]["deployments"]["Ingress"]
                nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("model_slot")]
                actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
            except Exception as e:  # noqa: BLE001 - the controller may be busy: the next tick tries again
                print(f"monitor: {e}", file=sys.stderr)
                continue
            replicas = {r["replica_id"].rsplit("#", 1)[-1]: [_name(r["state"]), r.get("node_id") or ""]
                        for r in deployment["replicas"]}
            prefix = f"EngineCore:{APP}#{DEPLOYMENT}#"
            engines = {a["Name"][len(prefix):]: a["Address"]["NodeID"] for a in actors
                       if (a.get("Name") or "").startswith(prefix)}
            for r in ingress["replicas"]:
                if r.get("node_id") and r["node_id"] not in self.report.ingress_nodes:
                    self.report.ingress_nodes.append(r["node_id"])
            self.report.ticks.append(Tick(self.now(), _name(deployment["status"]), deployment["target_num_replicas"],
                                          replicas, engines, nodes))
            self.report.decisions = (deployment.get("autoscaling_detail") or {}).get("decisions", [])

    def wait(self, what: str, condition, timeout_s: float | None = None) -> None:
        """Until condition() holds; the scenario fails past its deadline (never a fixed sleep)."""
        limit = min(self.deadline, time.monotonic() + timeout_s) if timeout_s else self.deadline
        while not condition():
            if time.monotonic() > limit:
                raise TimeoutError(f"timed out waiting for: {what}")
            time.sleep(0.25)
        self.mark(what)

    # ---- load ------------------------------------------------------------------------------------------------------
    async def _one(self, client: httpx.AsyncClient, max_tokens: int, accepted: asyncio.Event) -> Record:
        record = Record(self.phase, self.now())
        self.report.records.append(record)
        words = " ".join(random.choice(["red", "blue", "green", "cat", "dog", "sun"]) for _ in range(12))
        body = {"model": "tiny", "prompt": f"{random.random()} {words}", "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                record.status, record.replica = response.status_code, response.headers.get("x-pagoda-replica", "")
                accepted.set()
                if response.status_code != 200:
                    record.error = (await response.aread()).decode()[:300]
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        record.done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = json.dumps(chunk["error"])[:300]
                        continue
                    choice = chunk["choices"][0]
                    if choice.get("text"):
                        record.tokens += 1
                        record.first_token = record.first_token or self.now()
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
        except Exception as e:  # noqa: BLE001 - a failed request is data for the report
            record.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            record.end = self.now()
            accepted.set()  # a failed request does not hold the next client back
        return record

    async def _load(self, stop: threading.Event, streams: int, max_tokens: int) -> None:
        """`streams` clients, each sending one stream after another. Each client's first stream waits until the
        previous client's was accepted, so that the router sees it when it places the next."""
        accepted = [asyncio.Event() for _ in range(streams)]

        async def worker(i: int):
            if i:
                await accepted[i - 1].wait()
            while not stop.is_set():
                await self._one(client, max_tokens, accepted[i])

        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600, connect=30),
                                     limits=httpx.Limits(max_connections=streams + 8)) as client:
            await asyncio.gather(*(worker(i) for i in range(streams)))

    def start_load(self, streams: int, max_tokens: int) -> tuple[threading.Event, threading.Thread]:
        stop = threading.Event()
        thread = threading.Thread(target=lambda: asyncio.run(self._load(stop, streams, max_tokens)), daemon=True)
        thread.start()
        return stop, thread

    def in_flight(self) -> list[Record]:
        return [r for r in list(self.report.records) if r.end is None and r.replica]

    def health(self) -> str:
        try:
            response = httpx.get(f"{self.url}/health", timeout=10)
            return response.json().get("status", str(response.status_code)) if response.status_code == 200 \
                else str(response.status_code)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__

    # ---- the phases ------------------------------------------------------------------------------------------------
    def run(self) -> Report:
        import ray

        self.deploy()
        self.report.head_node = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("head"))
        stop, load = self.start_load(self.streams, MAX_TOKENS)
        self.wait(f"{MAX_REPLICAS} replicas running", lambda: self.running() == MAX_REPLICAS)
        self.phase = "kill"
        self.kill_a_node()
        # Long streams in flight while a replica drains: LONG_STREAMS of them, started while both replicas run the
        # short load about evenly. The router gives each to the shorter queue of two, so once the queues are level
        # the streams alternate: both replicas hold some. (The replacement starts empty while the survivor holds
        # every short stream; started then, all the long ones went to the newcomer, and Serve stopped the other.)
        # Only then does the short load stop, and with it the policy's reason for two replicas (LONG_STREAMS
        # ongoing are one replica's target): whichever replica Serve stops has long streams to drain.
        self.wait("both replicas carry the short load", self.short_load_level, timeout_s=180)
        self.phase = "down"
        long_stop, long_load = self.start_load(LONG_STREAMS, LONG_MAX_TOKENS)
        stop.set()
        load.join(timeout=max(1.0, self.deadline - time.monotonic()))
        self.mark("load stopped")
        self.wait("scaled down to 1 replica", lambda: len(self.report.ticks[-1].replicas) == 1 == self.running())
        self.wait("idle nodes removed", lambda: len(self.report.ticks[-1].model_nodes) == 1)
        long_stop.set()
        long_load.join(timeout=max(1.0, self.deadline - time.monotonic()))
        self.mark("load finished")
        self._stop_monitor.set()
        return self.report

    def short_load_level(self) -> bool:
        """Each running replica has short streams in flight, and their counts differ by less than LONG_STREAMS
        minus 2: of LONG_STREAMS streams placed on the shorter queue each, both replicas get at least one. The
        requests retried off the lost replica count too: they carry its tag (the retry is the ingress's), so
        while any is in flight, where the load is is not known."""
        running = [tag for tag, (state, _) in self.report.ticks[-1].replicas.items() if state == "RUNNING"]
        in_flight = self.in_flight()
        counts = [sum(r.replica == tag for r in in_flight) for tag in running]
        return (len(counts) == MAX_REPLICAS and min(counts) > 0 and max(counts) - min(counts) <= LONG_STREAMS - 2
                and all(r.replica in running for r in in_flight))

    def kill_a_node(self) -> None:
        """The node of the replica with the most requests in flight stops answering once that replica has some
        queued (no token yet) and some streaming; once the cluster has noticed, its processes are killed."""
        from tests.cluster.fake_cluster import freeze_node, kill_frozen, node_processes

        known = {tag: node_processes(self.head_pid, node) for tag, (_, node) in self.report.ticks[-1].replicas.items()}

        def victim() -> str | None:
            by_replica: dict[str, list[Record]] = {}
            for r in self.in_flight():
                by_replica.setdefault(r.replica, []).append(r)
            for replica, records in sorted(by_replica.items(), key=lambda kv: -len(kv[1])):
                if sum(r.tokens == 0 for r in records) >= 2 and any(r.tokens > 0 for r in records):
                    return replica
            return None

        self.wait("a replica with requests queued and streaming", lambda: victim() is not None)
        replica = victim()
        node = self.report.ticks[-1].replicas[replica][1]
        frozen = freeze_node(self.head_pid, node, known.get(replica, set()))
        self.mark(f"froze node {node[-5:]} of replica {replica}")
        killed = self.report.killed
        in_flight = [r for r in self.in_flight() if r.replica == replica]  # nothing more comes from the node
        killed.update(replica=replica, node=node, at=self.now(), processes=len(frozen),
                      queued=sum(r.tokens == 0 for r in in_flight), streaming=sum(r.tokens > 0 for r in in_flight),
                      health_seen=[])
        threading.Thread(target=self._watch_health, args=(killed["health_seen"],), daemon=True).start()
        self.wait("the cluster noticed the node's death", lambda: node not in self.report.ticks[-1].model_nodes)
        killed["noticed_after_s"] = round(self.now() - killed["at"], 2)
        kill_frozen(frozen)
        self.wait("replica replaced", lambda: self.running() == MAX_REPLICAS
                  and len(self.report.ticks[-1].model_nodes) == MAX_REPLICAS)
        killed["replaced_after_s"] = round(self.now() - killed["at"], 2)
        killed["health_after"] = self.health()

    def _watch_health(self, seen: list[str]) -> None:
        while self.phase == "kill":
            status = self.health()
            if not seen or seen[-1] != status:
                seen.append(status)
            time.sleep(0.5)


def _name(value) -> str:
    """An enum's value (Serve's details hold enums), or the string itself."""
    return str(getattr(value, "value", value))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--head-pid", type=int, required=True)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--deadline-s", type=float, default=420)
    parser.add_argument("--output", required=True, help="where the JSON report goes (Ray prints on stdout too)")
    args = parser.parse_args(argv)
    scenario = Scenario(args.address, args.head_pid, args.streams, args.deadline_s)
    error = None
    try:
        scenario.run()
    except Exception as e:  # noqa: BLE001 - reported with what was measured so far
        error = f"{type(e).__name__}: {e}"
    with open(args.output, "w") as f:
        json.dump({"error": error, **asdict(scenario.report)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
