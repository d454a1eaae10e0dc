"""`pagoda serve` as users run it, for tests: a subprocess with its own Ray (its own temp dir, ports and files, apart
from the session's cluster), started, read, stopped, and everything it left behind killed and removed."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from deploy import serve_env
from tests.procs import alive, descendants, environ, kill

REPO = Path(__file__).resolve().parents[1]


class ServeProcess:
    """`python -m deploy.cli serve ARGS` on `port`. env: extra environment; tmpdir: its TMPDIR (where HAProxy's
    private directory goes). Kills only what it started."""

    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None, tmpdir: str | None = None):
        self.port, self.tmpdir = port, tmpdir
        self.ray_tmp = tempfile.mkdtemp(prefix="pgcli", dir="/tmp")  # short: Ray's socket paths live under it
        # Not the session cluster's settings (its HAProxy's ports among them): the CLI chooses its own.
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SERVE_", "PAGODA_HAPROXY"))}
        full_env.update(PAGODA_TORCH_THREADS="1", RAY_TMPDIR=self.ray_tmp, PYTHONUNBUFFERED="1", **(env or {}))
        if tmpdir:
            full_env["TMPDIR"] = tmpdir
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.tree: set[int] = set()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "pagoda: serving" in line:
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float) -> None:
        assert self.ready.wait(timeout_s), self.output[-6000:]

    def processes(self) -> set[int]:
        """Every process below the CLI now (remembered, so that close() can kill what outlives it)."""
        self.tree |= descendants(self.proc.pid)
        return descendants(self.proc.pid)

    def haproxy_dir(self) -> str | None:
        """The private directory of HAProxy's files that the CLI made, as its Ray processes were told (None before
        they start, or without HAProxy)."""
        for pid in self.processes():
            found = environ(pid).get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
            if found:
                return found
        return None

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 120) -> int:
        self.processes()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout_s)
        self._drainer.join(timeout=30)  # its last lines
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        kill(alive(self.tree))  # only processes this test started
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        # a CLI killed outright could not remove its HAProxy directory: it is marked with the CLI, now gone
        for parent in {self.tmpdir or tempfile.gettempdir(), "/tmp"}:
            serve_env.remove_abandoned_dirs(parent)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

