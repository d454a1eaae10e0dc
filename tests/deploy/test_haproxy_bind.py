"""HAProxy's stats page and metrics exporter bound to the serving host, and request bodies not spliced: the script
`pagoda serve` runs in place of HAProxy rewrites the two bind lines and the `option splice-request` of Serve's
template, and the real HAProxy accepts the result (its check mode). tests/cluster/test_serve_faults.py shows why
requests must not be spliced (a client that leaves is otherwise not passed on)."""

import os
import subprocess

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
