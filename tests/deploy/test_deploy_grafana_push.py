"""deploy/grafana_push.py against a stand-in for Grafana's HTTP API.

No Grafana server can be installed here, so the server below is a recording stand-in: a real HTTP server
on 127.0.0.1 that answers the few endpoints `pagoda grafana push` uses (GET/POST /api/folders,
POST /api/dashboards/db) the way Grafana documents them, and records every request it receives. The
client side is real: grafana-client over HTTP.
"""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.grafana_push import DASHBOARD_PATH, add_grafana_args, push_dashboard, run_grafana_push

TOKEN = "glsa_test_token"


class GrafanaStandIn(ThreadingHTTPServer):
    """Answers like Grafana for folders and dashboards; `requests` holds (method, path, headers, body)."""

    def __init__(self, folders=(), status=200):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folders = list(folders)
        self.status = status
        self.requests = []

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append((self.command, self.path, dict(self.headers), body))
        return body

    def do_GET(self):
        self._record()
        if self.server.status != 200:
            return self._answer(self.server.status, {"message": "invalid API key"})
        if self.path.split("?")[0].endswith("/api/folders"):
            return self._answer(200, self.server.folders)
        self._answer(404, {"message": "Not found"})

    def do_POST(self):
        body = self._record()
        if self.server.status != 200:
            return self._answer(self.server.status, {"message": "invalid API key"})
        if self.path.endswith("/api/folders"):
            folder = {"id": 7, "uid": "f-new", "title": body["title"], "url": "/dashboards/f/f-new/"}
            self.server.folders.append(folder)
            return self._answer(200, folder)
        if self.path.endswith("/api/dashboards/db"):
            uid = body["dashboard"]["uid"]
            return self._answer(200, {"id": 11, "uid": uid, "url": f"/d/{uid}/pagoda", "status": "success",
                                      "version": 1, "slug": "pagoda"})
        self._answer(404, {"message": "Not found"})


@pytest.fixture
def grafana(request, monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    kwargs = getattr(request, "param", {})
    server = GrafanaStandIn(**kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _calls(server):
    return [(method, path.split("?")[0]) for method, path, _, _ in server.requests]


def _pushed(server):
    (body,) = [body for method, path, _, body in server.requests if path == "/api/dashboards/db"]
    return body


def test_push_creates_the_missing_folder_then_the_dashboard(grafana):
    grafana.folders = [{"id": 1, "uid": "f-other", "title": "Other"}]
    result = push_dashboard(grafana.url, TOKEN, folder="Pagoda")

    assert _calls(grafana) == [("GET", "/api/folders"), ("POST", "/api/folders"), ("POST", "/api/dashboards/db")]
    assert grafana.requests[1][3] == {"title": "Pagoda"}
    for _, _, headers, _ in grafana.requests:
        assert headers["Authorization"] == f"Bearer {TOKEN}"
    body = _pushed(grafana)
    expected = json.loads(DASHBOARD_PATH.read_text())
    expected["id"] = None
    assert body["dashboard"] == expected
    assert body["folderUid"] == "f-new"
    assert body["overwrite"] is True
    assert result["uid"] == "pagoda-overview" and result["status"] == "success"


def test_push_reuses_an_existing_folder(grafana):
    grafana.folders = [{"id": 3, "uid": "f-pagoda", "title": "Pagoda"}]
    push_dashboard(grafana.url, TOKEN, folder="Pagoda")
    assert _calls(grafana) == [("GET", "/api/folders"), ("POST", "/api/dashboards/db")]
    assert _pushed(grafana)["folderUid"] == "f-pagoda"


def test_push_without_folder_goes_to_general(grafana):
    push_dashboard(grafana.url, TOKEN)
    assert _calls(grafana) == [("POST", "/api/dashboards/db")]
    assert "folderUid" not in _pushed(grafana)


def test_push_under_a_sub_path(grafana, tmp_path):
    """Grafana served under /grafana (root_url with a sub-path), and a dashboard file of one's own."""
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"uid": "own", "title": "Own", "id": 42, "panels": []}))
    push_dashboard(grafana.url + "/grafana", TOKEN, dashboard_path=own)
    method, path, _, body = grafana.requests[0]
    assert (method, path) == ("POST", "/grafana/api/dashboards/db")
    assert body["dashboard"] == {"uid": "own", "title": "Own", "id": None, "panels": []}


def test_cli_push(grafana, capsys):
    parser = argparse.ArgumentParser(prog="pagoda grafana push")
    add_grafana_args(parser)
    args = parser.parse_args(["--url", grafana.url, "--token", TOKEN, "--folder", "Pagoda"])
    assert run_grafana_push(args) == 0
    assert f"{grafana.url}/d/pagoda-overview/pagoda" in capsys.readouterr().out
    assert _pushed(grafana)["folderUid"] == "f-new"


def test_cli_takes_url_and_token_from_the_environment(grafana, monkeypatch):
    monkeypatch.setenv("GRAFANA_URL", grafana.url)
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    parser = argparse.ArgumentParser()
    add_grafana_args(parser)
    args = parser.parse_args([])
    assert (args.url, args.token, args.folder) == (grafana.url, TOKEN, None)


@pytest.mark.parametrize("grafana", [{"status": 401}], indirect=True)
def test_cli_reports_a_refused_token(grafana, capsys):
    parser = argparse.ArgumentParser()
    add_grafana_args(parser)
    args = parser.parse_args(["--url", grafana.url, "--token", "wrong", "--folder", "Pagoda"])
    assert run_grafana_push(args) == 1
    assert "Unauthorized" in capsys.readouterr().err
