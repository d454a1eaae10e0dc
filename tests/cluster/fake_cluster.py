"""A multi-node Ray cluster on one machine whose worker nodes come and go by Ray's real autoscaler (the
`fake_multinode` node provider: each "node" is a raylet of its own, with the resources of its node type).

    FakeCluster.start()   `ray start --head --block` (own GCS port, own short temp dir, RAY_FAKE_CLUSTER=1)
        head: GCS, raylet, the autoscaler (monitor) ──launches/terminates──► worker nodes: raylet + workers
    freeze_node(head_pid, node_id)   SIGSTOP every process of a node (its raylet and workers carry
                                     RAY_OVERRIDE_NODE_ID_FOR_TESTING; its agents run below its raylet): a host
                                     that stops answering; kill_frozen() then ends them (kill_node: both at once)
    FakeCluster.stop()    every process below the head's `ray start`, and the temp dir

Not `ray.cluster_utils.AutoscalingCluster`: it runs `ray stop --force`, which kills every Ray process on the
machine (other tests', other users'). The config is written here (the wheel lacks the provider's example.yaml),
and only this cluster's own processes are ever signalled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port
from tests.procs import alive, descendants, environ, kill

REPO = Path(__file__).resolve().parents[2]
HEAD_NODE_TYPE = "ray.head.default"  # the provider's fixed name for the head
NODE_ID_VAR = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"  # the provider gives each node's processes its id


@dataclass(frozen=True)
class NodeType:
    resources: dict[str, float]
    min_workers: int = 0
    max_workers: int = 1


def autoscaling_config(head_resources: dict[str, float], worker_types: dict[str, NodeType], gcs_address: str,
                       idle_timeout_s: float) -> dict:
    """The whole cluster config the autoscaler reads (it reads the file as is: no defaults are merged in)."""
    types = {HEAD_NODE_TYPE: {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}}
    for name, t in worker_types.items():
        types[name] = {"resources": dict(t.resources), "node_config": {}, "min_workers": t.min_workers,
                       "max_workers": t.max_workers}
    return {
        "cluster_name": "pagoda-fake", "max_workers": sum(t.max_workers for t in worker_types.values()),
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": types, "head_node_type": HEAD_NODE_TYPE,
        "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60, "auth": {}, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    }


@dataclass
class FakeCluster:
    head_resources: dict[str, float]  # CPU and custom resources of the head
    worker_types: dict[str, NodeType]
    idle_timeout_s: float = 6.0  # an idle worker node is removed after this long
    env: dict[str, str] = field(default_factory=dict)  # for every Ray process of the cluster
    system_config: dict | None = None
    port: int = field(default_factory=free_port)
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pgfake", dir="/tmp"))  # short: sockets
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def process_env(self) -> dict[str, str]:
        """The environment of the head (the autoscaler passes it to the worker nodes it starts) and of drivers."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_"))}
        env.update(RAY_TMPDIR=self.temp_dir, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                   RAY_AUTH_MODE="disabled")  # a private test cluster: no token (else ~/.ray/auth_token)
        return env | self.env

    def start(self, timeout_s: float = 120.0) -> None:
        config_path = Path(self.temp_dir) / "autoscaling.json"
        config_path.write_text(json.dumps(autoscaling_config(self.head_resources, self.worker_types, self.address,
                                                             self.idle_timeout_s)))
        resources = {k: v for k, v in self.head_resources.items() if k != "CPU"}
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--port={self.port}", f"--temp-dir={self.temp_dir}", f"--autoscaling-config={config_path}",
               f"--num-cpus={int(self.head_resources.get('CPU', 1))}", "--num-gpus=0",
               f"--resources={json.dumps(resources)}", "--include-dashboard=false", "--disable-usage-stats",
               f"--ray-client-server-port={free_port()}", "--dashboard-agent-listen-port=0",
               "--node-ip-address=127.0.0.1"]
        if self.system_config:
            cmd.append(f"--system-config={json.dumps(self.system_config, separators=(',', ':'))}")
        log = open(Path(self.temp_dir) / "head.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.process_env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not (Path(self.temp_dir) / "ray_current_cluster").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake cluster's head did not start:\n{self.head_log()[-4000:]}")
            time.sleep(0.2)

    def head_log(self) -> str:
        try:
            return (Path(self.temp_dir) / "head.log").read_text()
        except OSError:
            return ""

    def processes(self) -> set[int]:
        return cluster_processes(self.proc.pid) if self.proc is not None else set()

    def kill_node(self, node_id: str) -> int:
        return kill_node(self.proc.pid, node_id)

    def stop(self) -> None:
        if self.proc is not None:
            kill_frozen(_freeze(lambda: self.processes() | alive({self.proc.pid})))
            self.proc.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def cluster_processes(head_pid: int) -> set[int]:
    """Every live process of the cluster whose head `ray start` is head_pid: all of them run below it."""
    return alive(descendants(head_pid))


def node_processes(head_pid: int, node_id: str) -> set[int]:
    """A worker node's processes: its raylet and workers carry its id; its agents run below its raylet."""
    own = {pid for pid in cluster_processes(head_pid) if environ(pid).get(NODE_ID_VAR) == node_id}
    return own.union(*(descendants(pid) for pid in own))


def freeze_node(head_pid: int, node_id: str, known: set[int] = frozenset()) -> set[int]:
    """Stops (SIGSTOP) every process of one worker node: a machine that stops answering, its connections open.
    `known`: its processes found earlier, stopped at once (finding them takes a while on a loaded machine)."""
    still = {pid for pid in known if environ(pid).get(NODE_ID_VAR) == node_id}  # not a pid reused since
    kill(still, signal.SIGSTOP)
    return still | _freeze(lambda: node_processes(head_pid, node_id))


def kill_node(head_pid: int, node_id: str) -> int:
    """Kills every process of one worker node at once; returns how many."""
    return len(kill_frozen(freeze_node(head_pid, node_id)))


def _freeze(find) -> set[int]:
    """SIGSTOP what `find()` returns until it finds nothing new: a stopped process cannot start another, so no
    child escapes as an orphan."""
    frozen: set[int] = set()
    while new := find() - frozen:
        kill(new, signal.SIGSTOP)
        frozen |= new
    return frozen


def kill_frozen(frozen: set[int]) -> set[int]:
    kill(frozen, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive(frozen) and time.monotonic() < deadline:
        time.sleep(0.1)
    return frozen
