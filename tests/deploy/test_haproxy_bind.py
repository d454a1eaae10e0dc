"""HAProxy's stats page and metrics exporter bound to the serving host, and request bodies not spliced: the script
`pagoda serve` runs in place of HAProxy rewrites the two bind lines and the `option splice-request` of Serve's
template, and the real HAProxy accepts the result (its check mode). tests/cluster/test_serve_faults.py shows why
requests must not be spliced (a client that leaves is otherwise not passed on)."""

import os
import subprocess

import pytest

from deploy import haproxy_bind, serve_env


def _config(stats: str, metrics: str, port: int) -> str:
    # the lines of Ray Serve's template that matter here, in a config small enough to check
    return f"""global
    maxconn 16
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
    option abortonclose
    option splice-request
    option splice-response
frontend prometheus
    bind :{metrics}
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend default_backend
backend default_backend
    http-request return status 404
listen stats
  bind *:{stats}
  stats enable
"""


def test_serve_template_binds_stats_and_metrics_to_every_interface():
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    # what bind_to_host rewrites; a Serve that changes these lines needs haproxy_bind changed too
    assert "    bind :{{ config.metrics_port }}\n" in HAPROXY_CONFIG_TEMPLATE
    assert "  bind *:{{ config.stats_port }}\n" in HAPROXY_CONFIG_TEMPLATE
    assert "    option splice-request\n" in HAPROXY_CONFIG_TEMPLATE  # what unsplice_requests drops


def test_haproxy_runs_with_stats_and_metrics_on_the_host(tmp_path, monkeypatch):
    for name in (*serve_env.HAPROXY_PORT_VARS, serve_env.HAPROXY_BINARY_VAR, haproxy_bind.WRAPPER_VAR):
        monkeypatch.delenv(name, raising=False)  # the session cluster's
    env = serve_env.ingress_env("direct", str(tmp_path), host="127.0.0.1")
    stats, metrics = env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]
    config = tmp_path / "haproxy.cfg"
    config.write_text(_config(stats, metrics, 8000))
    wrapper = env[serve_env.HAPROXY_BINARY_VAR]
    assert os.path.dirname(wrapper) == str(tmp_path) and os.stat(wrapper).st_mode & 0o077 == 0
    done = subprocess.run([wrapper, "-c", "-f", str(config)], env=os.environ | env, capture_output=True, text=True,
                          check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr  # the real HAProxy read the rewritten config
    text = config.read_text()
    assert f"    bind 127.0.0.1:{metrics}\n" in text and f"  bind 127.0.0.1:{stats}\n" in text
    assert "    bind 127.0.0.1:8000\n" in text  # the frontend as Serve wrote it
    assert "splice-request" not in text and "    option splice-response\n" in text
    (tmp_path / "all").mkdir()
    everywhere = serve_env.ingress_env("direct", str(tmp_path / "all"), host="0.0.0.0")
    assert haproxy_bind.HOST_VAR not in everywhere  # every interface: the binds as Serve wrote them ...
    config.write_text(_config(stats, metrics, 8000))
    done = subprocess.run([everywhere[serve_env.HAPROXY_BINARY_VAR], "-c", "-f", str(config)],
                          env=os.environ | everywhere, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    text = config.read_text()
    assert f"    bind :{metrics}\n" in text and "splice-request" not in text  # ... and requests unspliced


def test_bind_to_host_rewrites_only_those_ports():
    config = _config("8404", "9101", 8404)
    bound = haproxy_bind.bind_to_host(config, "::1", ["8404", "9101"])
    assert "  bind ::1:8404\n" in bound and "    bind ::1:9101\n" in bound
    assert "    bind 127.0.0.1:8404\n" in bound  # a frontend with its own address is left alone


def test_haproxy_ends_with_the_process_that_started_it(tmp_path, monkeypatch):
    """Serve's proxy actor starts HAProxy; when the actor is killed (its cluster's end), HAProxy must not run on,
    holding its ports (reloaded ones, `-sf`, were seen running after their cluster had gone)."""
    import signal
    import sys
    import time

    from tests.ports import free_port

    for name in (*serve_env.HAPROXY_PORT_VARS, serve_env.HAPROXY_BINARY_VAR, haproxy_bind.WRAPPER_VAR):
        monkeypatch.delenv(name, raising=False)
    env = serve_env.ingress_env("direct", str(tmp_path), host="127.0.0.1")
    config = tmp_path / "haproxy.cfg"
    config.write_text(_config(env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"],
                              free_port()))
    starter = ("import subprocess, sys, time\n"
               f"p = subprocess.Popen([{env[serve_env.HAPROXY_BINARY_VAR]!r}, '-db', '-f', {str(config)!r}])\n"
               "print(p.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", starter], env=os.environ | env, stdout=subprocess.PIPE,
                              text=True)
    haproxy = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while os.path.basename(_cmdline(haproxy).split("\0")[0]) != "haproxy":  # the script, the wrapper, HAProxy
            assert time.monotonic() < deadline, "HAProxy did not start"
            time.sleep(0.1)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while _cmdline(haproxy):
            assert time.monotonic() < deadline, "HAProxy outlived the process that started it"
            time.sleep(0.1)
    finally:
        parent.kill()
        if _cmdline(haproxy):
            os.kill(haproxy, signal.SIGKILL)  # ours: started by this test


def _cmdline(pid: int) -> str:
    """The process's command line ("" once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_directories_of_owners_that_died_are_removed(tmp_path):
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_owner = tmp_path / "pagoda-haproxy-dead"
    live_owner = tmp_path / "pagoda-haproxy-live"
    unmarked = tmp_path / "pagoda-haproxy-unmarked"
    other = tmp_path / "somebody-else"
    for path in (dead_owner, live_owner, unmarked, other):
        path.mkdir()
    (dead_owner / serve_env.OWNER_FILE).write_text(f"{gone.stdout.strip()}:1")
    (dead_owner / "admin.sock").write_text("")
    (other / serve_env.OWNER_FILE).write_text(f"{gone.stdout.strip()}:1")
    (live_owner / serve_env.OWNER_FILE).write_text(serve_env._process_identity(os.getpid()))
    assert serve_env.remove_abandoned_dirs(str(tmp_path)) == [str(dead_owner)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pagoda-haproxy-live", "pagoda-haproxy-unmarked",
                                                         "somebody-else"]
    # this process's start time is part of its identity: the same pid with another start is another process
    (live_owner / serve_env.OWNER_FILE).write_text(f"{os.getpid()}:1")
    assert serve_env.remove_abandoned_dirs(str(tmp_path)) == [str(live_owner)]


def test_a_private_directory_names_its_owner(monkeypatch):
    for name in (*serve_env.HAPROXY_PORT_VARS, serve_env.HAPROXY_BINARY_VAR, haproxy_bind.WRAPPER_VAR):
        monkeypatch.delenv(name, raising=False)
    with serve_env.cluster_env("direct") as env:
        directory = serve_env.haproxy_dir(env)
        with open(os.path.join(directory, serve_env.OWNER_FILE)) as f:
            assert f.read() == serve_env._process_identity(os.getpid())
        assert os.stat(directory).st_mode & 0o777 == 0o700
    assert not os.path.exists(directory)


@pytest.mark.parametrize("host", ["127.0.0.1", None])  # bound to the host, or as Serve's template (every interface)
def test_the_cluster_holds_haproxy_ports_that_haproxy_still_binds_and_reloads_on(tmp_path, monkeypatch, host):
    """HAProxy binds its stats and metrics ports again at each reload and each time Serve starts it; in between, a
    second `pagoda serve` on the host drew one (its free_port finds it free) and the first cluster's HAProxy failed
    every later reload ("cannot bind socket (Address already in use)"). While cluster_env's block runs the ports are
    held: a plain bind (free_port's) fails on them, before HAProxy starts and after it stops, and the real HAProxy
    (as Serve runs it: -dR, reloads with -sf) binds, serves and reloads beside the holder. After the block they are
    free."""
    import socket
    import time
    import urllib.request

    from tests.ports import free_port

    def plain_bind_fails(port: str) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(port)))
            except OSError:
                return True
            return False

    def metrics_answer(port: str) -> int:
        deadline = time.monotonic() + 30
        while True:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).status
            except OSError:
                assert time.monotonic() < deadline, "HAProxy did not serve its metrics"
                time.sleep(0.1)

    for name in (*serve_env.HAPROXY_PORT_VARS, serve_env.HAPROXY_BINARY_VAR, haproxy_bind.WRAPPER_VAR):
        monkeypatch.delenv(name, raising=False)
    with serve_env.cluster_env("direct") as env:
        binary = env[haproxy_bind.BINARY_VAR]
        stats, metrics = env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]
        config = tmp_path / "haproxy.cfg"
        text = _config(stats, metrics, free_port())
        config.write_text(haproxy_bind.bind_to_host(text, host, [stats, metrics]) if host else text)
        assert plain_bind_fails(stats) and plain_bind_fails(metrics)  # before HAProxy starts
        first = subprocess.Popen([binary, "-db", "-dR", "-f", str(config)], stderr=subprocess.DEVNULL)
        second = None
        try:
            assert metrics_answer(metrics) == 200
            second = subprocess.Popen([binary, "-db", "-dR", "-f", str(config), "-sf", str(first.pid)],
                                      stderr=subprocess.DEVNULL)
            assert first.wait(timeout=30) == 0  # handed over to the reloaded one
            assert second.poll() is None and metrics_answer(metrics) == 200
        finally:
            for process in (first, second):  # ours, started here
                if process is not None and process.poll() is None:
                    process.terminate()
                    process.wait(timeout=30)
        assert plain_bind_fails(stats) and plain_bind_fails(metrics)  # HAProxy stopped, as between Serve restarts
    assert not plain_bind_fails(stats) and not plain_bind_fails(metrics)
