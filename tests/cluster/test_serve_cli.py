"""`pagoda serve` as users run it: a subprocess that starts its own Ray (its own temp dir, its own ports, apart
from the session's cluster), deploys an autoscaled app, answers the OpenAI client, and exits 0 on SIGINT leaving
no process behind."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port
from tests.procs import alive, descendants, kill, names

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180


@pytest.mark.timeout(360)
@pytest.mark.parametrize("ingress_mode", ["direct", "proxy"])
def test_pagoda_serve_answers_and_exits_cleanly_on_sigint(ingress_mode):
    import openai

    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="pgcli", dir="/tmp")  # short: Ray's socket paths live under it
    # Not the session cluster's settings (its HAProxy's ports among them): the CLI chooses its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_"))}
    env.update(PAGODA_TORCH_THREADS="1", RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "deploy.cli", "serve", "--model", "tiny", "--port", str(port), "--num-cpus", "2",
           "--num-kv-blocks", "64", "--replica-num-cpus", "0.5", "--served-model-name", "cli-tiny",
           "--api-key", "cli-key", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "4",
           "--ingress-mode", ingress_mode]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            lines.append(line)
            if "pagoda: serving" in line:
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    tree: set[int] = set()
    try:
        assert ready.wait(START_TIMEOUT_S), "".join(lines[-40:])
        assert f"http://127.0.0.1:{port}/v1" in "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli-key", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["cli-tiny"]
        out = client.completions.create(model="cli-tiny", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        tree = descendants(proc.pid)
        assert tree, "Ray's processes should run below the CLI"
        # direct: HAProxy holds the port and the ingress replicas serve HTTP; proxy: Serve's Python proxy does
        assert ("haproxy" in names(tree)) == (ingress_mode == "direct"), names(tree)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(lines[-40:])
        deadline = time.monotonic() + 30
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive(tree), f"left behind: {alive(tree)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        kill(alive(tree))  # only processes this test started
        shutil.rmtree(ray_tmp, ignore_errors=True)
