"""Two `pagoda serve` on one machine, each its own Ray cluster, one with an API key: no request to either ever
reaches the other, while the keyed one starts up and while its ingress replica is killed and replaced. (Both used
to leave Serve's fallback proxy on 127.0.0.1:8500 with SO_REUSEPORT, and HAProxy sends a request there while no
ingress replica is up: the kernel handed it to either cluster's proxy, past the key.)"""

import threading
import time

import httpx
import pytest

from tests.ports import free_port
from tests.procs import kill
from tests.serve_process import ServeProcess, command_line

START_TIMEOUT_S = 240
SMALL = ["--model", "tiny", "--num-cpus", "2", "--num-kv-blocks", "64", "--replica-num-cpus", "0.5"]


class Prober:
    """GET /v1/models on one port, with and without the key, again and again in a thread; keeps every answer."""

    def __init__(self, port: int, key: str | None):
        self.url, self.key = f"http://127.0.0.1:{port}/v1/models", key
        self.answers: list[tuple[bool, int, str]] = []  # (sent the key, status, body)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped.is_set():
            for keyed in ([False, True] if self.key else [False]):
                headers = {"Authorization": f"Bearer {self.key}"} if keyed else {}
                try:
                    r = httpx.get(self.url, headers=headers, timeout=10)
                except httpx.HTTPError:
                    continue  # nothing listens yet, or the request was cut: no answer to check
                self.answers.append((keyed, r.status_code, r.text))
            time.sleep(0.1)

    def keyed_ok_since(self, index: int) -> bool:
        return any(keyed and status == 200 for keyed, status, _ in self.answers[index:])

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_servers_on_one_host_never_answer_for_each_other(tmp_path):
    key = "only-a-knows"
    (tmp_path / "key").write_text(key + "\n")
    port_a, port_b = free_port(), free_port()
    with ServeProcess([*SMALL, "--served-model-name", "host-b"], port_b) as b:
        b.wait_ready(START_TIMEOUT_S)
        probe_b = Prober(port_b, None)
        probe_a = Prober(port_a, key)  # from before A starts: its start-up is probed too
        args_a = [*SMALL, "--served-model-name", "host-a", "--api-key-file", str(tmp_path / "key")]
        with ServeProcess(args_a, port_a) as a:
            a.wait_ready(START_TIMEOUT_S)
            deadline = time.monotonic() + 60
            while not probe_a.keyed_ok_since(0) and time.monotonic() < deadline:
                time.sleep(0.5)
            ingress = {pid for pid in a.processes() if "ServeReplica:pagoda:Ingress" in command_line(pid)}
            assert ingress, "A's ingress replica should run below its CLI"
            killed_at = len(probe_a.answers)
            kill(ingress)
            deadline = time.monotonic() + 180  # Serve notices and starts another
            while not probe_a.keyed_ok_since(killed_at + 1) and time.monotonic() < deadline:
                time.sleep(0.5)
            probe_a.stop()
            probe_b.stop()
            assert probe_a.keyed_ok_since(killed_at + 1), a.output[-4000:]
    keyless_a = [(status, body) for keyed, status, body in probe_a.answers if not keyed]
    keyed_a = [(status, body) for keyed, status, body in probe_a.answers if keyed]
    assert keyless_a and keyed_a and probe_b.answers
    # A's own HAProxy may answer 404 or 503 while it has no ingress replica; never 200 without the key
    assert [body for s, body in keyless_a if s == 200 or "host-b" in body] == [], "a key-less request to A passed"
    assert [body for s, body in keyed_a if "host-b" in body or (s == 200 and '"host-a"' not in body)] == []
    assert [body for _, s, body in probe_b.answers if "host-a" in body or (s == 200 and '"host-b"' not in body)] == []


def test_each_cluster_environment_has_fallback_ports_of_its_own(monkeypatch, tmp_path):
    from deploy import serve_env

    for name in (*serve_env.FALLBACK_PORT_VARS, serve_env.NO_SHARED_PORTS[0]):
        monkeypatch.delenv(name, raising=False)  # the session cluster's
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, two = (serve_env.ingress_env("direct", str(tmp_path / name)) for name in ("one", "two"))
    ports = [int(env[name]) for env in (one, two) for name in serve_env.FALLBACK_PORT_VARS]
    assert len(set(ports)) == 4 and not {8500, 9500} & set(ports)  # Serve's shared defaults
    low, high = serve_env.ephemeral_ports()
    assert not [p for p in ports if low <= p <= high]  # none an outgoing connection may take before Serve binds it
    for env in (one, two, serve_env.ingress_env("proxy")):
        assert env["SERVE_SOCKET_REUSE_PORT_ENABLED"] == "0"  # a taken port fails, never shares


def test_ports_chosen_for_a_cluster_are_none_that_ray_or_serve_hand_out(monkeypatch):
    """HAProxy binds its stats and metrics ports again at each reload: a metrics port drawn from Serve's ingress
    range (30000-30999, which every cluster's controller allocates from its start without asking whether a port is
    free) was taken by an ingress replica while `make serve` ran beside the test suite, and every later deployment
    update failed. The ports drawn keep out of Serve's ingress ranges and Ray's worker ports, whatever the machine's
    ephemeral range, and Serve's own variables move the ranges they name."""
    from deploy import serve_env

    for low in (32768, 49152, 1024):  # Linux's default, the IANA range some machines use, one with little below
        monkeypatch.setattr(serve_env, "ephemeral_ports", lambda low=low: (low, 65535))
        candidates = serve_env.free_port_candidates()
        assert len(candidates) > 5000
        assert not [p for p in candidates if 30000 <= p <= 31000 or 40000 <= p <= 41000 or 10002 <= p <= 19999]
        assert all(p < low for p in candidates) or low <= 13024
    monkeypatch.setattr(serve_env, "ephemeral_ports", lambda: (32768, 60999))
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "25000")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "26000")
    candidates = serve_env.free_port_candidates()
    assert 25500 not in candidates and 30500 in candidates
    for name in serve_env.HAPROXY_PORT_VARS:
        monkeypatch.delenv(name, raising=False)
    ports = [serve_env.free_port() for _ in range(50)]
    assert not [p for p in ports if 25000 <= p <= 26000 or 10002 <= p <= 19999 or p >= 32768]


def test_the_session_cluster_keeps_its_files_out_of_the_machine_s_shared_ray_dir(ray_cluster):
    """Other clusters on the machine keep their sessions, logs and `ray_current_cluster` in /tmp/ray: the test
    session's cluster has its own temp dir (conftest's own_ray_temp_dir), and its workers run under it."""
    import os

    from ray._private.worker import global_worker

    own = os.environ["RAY_TMPDIR"]
    session = global_worker.node.get_session_dir_path()
    assert os.path.realpath(session).startswith(os.path.realpath(own) + os.sep)

    @ray_cluster.remote(num_cpus=0)
    def logs_of_a_worker() -> str:
        from ray._private.worker import global_worker as worker  # the task's own, not the driver's pickled

        return os.path.realpath(worker.node.get_logs_dir_path())

    assert ray_cluster.get(logs_of_a_worker.remote()).startswith(os.path.realpath(own) + os.sep)
