"""`pagoda serve` as users run it: a subprocess that starts its own Ray (its own temp dir, its own ports, apart
from the session's cluster), deploys an autoscaled app, answers the OpenAI client, listens only where it says, and
exits 0 on SIGINT leaving no process behind."""

import os
import signal
import time

import httpx
import pytest

from tests.ports import free_port
from tests.procs import alive, listeners, names
from tests.serve_process import ServeProcess, command_line

START_TIMEOUT_S = 180


def _all_interfaces_outside_serve_grpc(serve: ServeProcess) -> list[tuple[str, int, str]]:
    """What the server's processes listen on beyond loopback. Allowed: each Serve replica's inter-deployment gRPC
    server (Ray Serve 2.60 binds it to [::]:0 itself; Ray's token authentication guards it), one a replica."""
    seen, open_ = {}, []
    for address, port, pid in listeners(serve.processes()):
        if address in ("127.0.0.1", "::1"):
            continue
        name = command_line(pid)
        if address == "::" and "ServeReplica:" in name and pid not in seen:
            seen[pid] = port
            continue
        open_.append((address, port, name[:60]))
    return open_


def test_the_api_key_comes_from_a_file_the_flag_or_the_environment(tmp_path, monkeypatch):
    from deploy.cli import build_parser, serve_app_args

    def key(*flags):
        return serve_app_args(build_parser().parse_args(["serve", *flags]))["api_key"]

    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert key("--api-key-file", str(path)) == "from-file"
    assert key("--api-key", "from-flag") == "from-flag"
    assert key() is None
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    assert key() == "from-env"
    assert key("--api-key-file", str(path)) == "from-file"
    for content, problem in [("", "one key"), ("two\nlines", "one key")]:
        path.write_text(content)
        with pytest.raises(ValueError, match=problem):
            key("--api-key-file", str(path))
    with pytest.raises(ValueError, match="cannot read"):
        key("--api-key-file", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        key("--api-key-file", str(path), "--api-key", "x")


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("ingress_mode", ["direct", "proxy"])
def test_pagoda_serve_answers_and_exits_cleanly_on_sigint(ingress_mode, tmp_path):
    import openai

    port = free_port()
    args = ["--model", "tiny", "--num-cpus", "2", "--num-kv-blocks", "64", "--replica-num-cpus", "0.5",
            "--served-model-name", "cli-tiny", "--min-replicas", "1", "--max-replicas", "2",
            "--target-ongoing-requests", "4", "--ingress-mode", ingress_mode]
    env = {}
    if ingress_mode == "direct":  # the key in a file, or in the environment: never on a command line
        (tmp_path / "key").write_text("cli-key\n")
        args += ["--api-key-file", str(tmp_path / "key")]
    else:
        env["PAGODA_API_KEY"] = "cli-key"
    with ServeProcess(args, port, env) as serve:
        serve.wait_ready(START_TIMEOUT_S)
        assert f"http://127.0.0.1:{port}/v1" in serve.output
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli-key", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["cli-tiny"]
        out = client.completions.create(model="cli-tiny", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        tree = serve.processes()
        assert tree, "Ray's processes should run below the CLI"
        # direct: HAProxy holds the port and the ingress replicas serve HTTP; proxy: Serve's Python proxy does
        assert ("haproxy" in names(tree)) == (ingress_mode == "direct"), names(tree)
        # --host 127.0.0.1: Ray's own servers, its metrics exporter, HAProxy's stats and metrics all on loopback
        assert _all_interfaces_outside_serve_grpc(serve) == []
        assert [pid for pid in tree | {serve.proc.pid} if "cli-key" in command_line(pid)] == []  # what ps shows
        private = serve.haproxy_dir()
        assert (private is not None) == (ingress_mode == "direct")
        assert serve.stop() == 0, serve.output[-4000:]
        _assert_nothing_left(serve, private)
        assert "pagoda: shutting down" in serve.output
        assert "graceful_shutdown failed" not in serve.output  # Serve's warning on every stop, before


def _assert_nothing_left(serve: ServeProcess, private: str | None) -> None:
    deadline = time.monotonic() + 30
    while alive(serve.tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(serve.tree), f"left behind: {alive(serve.tree)}"
    assert private is None or not os.path.exists(private), f"left behind: {private}"


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_pagoda_serve_stopped_while_it_starts_leaves_nothing_behind():
    # a replica that no node can hold: the start never ends, so the signal comes while HAProxy and the ingress run
    args = ["--model", "tiny", "--num-cpus", "2", "--num-kv-blocks", "64", "--replica-num-cpus", "0.5",
            "--replica-resources", '{"no_such_node": 1}']
    with ServeProcess(args, free_port()) as serve:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ("haproxy" in names(serve.processes()) and serve.haproxy_dir()) and time.monotonic() < deadline:
            time.sleep(1)
        private = serve.haproxy_dir()
        assert private and os.path.isdir(private), serve.output[-4000:]
        assert serve.stop(signal.SIGTERM) == 0, serve.output[-4000:]
        assert "pagoda: serving" not in serve.output
        _assert_nothing_left(serve, private)


def test_a_port_taken_after_it_was_chosen_starts_again():
    """The start-up errors of a port another process took after `free_port` chose it (HAProxy's, and Serve's
    fallback proxy's, which failed `make serve` once here) make `pagoda serve` start again on other ports; other
    errors do not."""
    from deploy.cli import _is_port_race

    assert _is_port_race(RuntimeError("Failed to bind to address '127.0.0.1:44217'."))
    assert _is_port_race(OSError("[Errno 98] Address already in use"))
    assert not _is_port_race(ValueError("--port must be in 1-65535, got 0"))


def test_a_cluster_environment_is_undone_however_its_block_ends(monkeypatch):
    from deploy.serve_env import FALLBACK_PORT_VARS, cluster_env, haproxy_dir

    monkeypatch.delenv(FALLBACK_PORT_VARS[0], raising=False)
    with pytest.raises(RuntimeError), cluster_env("direct") as env:
        private = haproxy_dir(env)
        assert os.path.isdir(private) and os.environ[FALLBACK_PORT_VARS[0]] == env[FALLBACK_PORT_VARS[0]]
        raise RuntimeError("a start that failed")
    assert not os.path.exists(private) and FALLBACK_PORT_VARS[0] not in os.environ


def test_a_cluster_environment_inside_another_removes_only_its_own_directory(monkeypatch):
    """A cluster_env entered where another's variables are set (the test session's cluster, a shell that exported
    them) keeps their HAProxy files and removes only what it made. It removed the outer one's private directory:
    in CI the session's HAProxy then lost its files and every later serve test's connection was refused."""
    from deploy.serve_env import HAPROXY_FILE_VARS, cluster_env, haproxy_dir

    for name in HAPROXY_FILE_VARS:
        monkeypatch.delenv(name, raising=False)
    with cluster_env("direct") as outer:
        outer_dir = haproxy_dir(outer)
        with cluster_env("direct") as inner:
            inner_dir = haproxy_dir(inner)
            assert inner_dir != outer_dir and os.path.isdir(inner_dir)
            assert all(inner[name] == outer[name] for name in HAPROXY_FILE_VARS)  # the caller's, kept
        assert not os.path.exists(inner_dir)
        assert os.path.isdir(outer_dir) and os.listdir(outer_dir)
    assert not os.path.exists(outer_dir)


@pytest.mark.parametrize(("flags", "named"), [
    (["--max-queued-requests", "-2"], "--max-queued-requests"),  # Pagoda's check
    (["--replica-resources", '{"slot": -1}'], "cannot be negative"),  # Ray's, run as the app is built
    (["--replica-resources", '{"CPU": 1}'], "num_cpus"),  # Serve's: the CPU count has its own flag
    (["--num-replicas", "0"], "--num-replicas"),  # was served with 1
    (["--min-replicas", "3", "--max-replicas", "2"], "max_replicas"),
    (["--port", "70000"], "--port"),
    (["--host", "no-such-host.invalid"], "--host"),
    (["--num-cpus", "0"], "--num-cpus"),
    (["--model", "/no/such/model"], "'/no/such/model' is not a checkpoint directory"),  # was a failed deployment
    (["--speculative-config", '{"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2}'],
     "speculative_config.model"),
])
def test_pagoda_serve_refuses_a_bad_flag_before_anything_starts(flags, named, monkeypatch, capsys):
    import ray

    from deploy.cli import main

    def started(*args, **kwargs):  # stands in for Ray, which a refused flag must never reach
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", started)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the session's cluster, if up, is not to be joined
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    assert main(["serve", "--model", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error:") and named in err, err
