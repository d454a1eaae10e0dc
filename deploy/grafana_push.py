"""Push Pagoda's Grafana dashboard through Grafana's HTTP API: `pagoda grafana push`.

Uses `grafana-client`, the maintained successor of the archived `grafana-api` package. The dashboard is
deploy/grafana/pagoda.json; pushing it again replaces it (same uid, overwrite=True).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grafana_client import GrafanaApi

DASHBOARD_PATH = Path(__file__).parent / "grafana" / "pagoda.json"


def load_dashboard(dashboard_path: str | Path | None = None) -> dict:
    """The dashboard model, ready for the API: `id` cleared so that Grafana matches it by uid."""
    with open(dashboard_path or DASHBOARD_PATH, encoding="utf-8") as f:
        dashboard = json.load(f)
    dashboard["id"] = None
    return dashboard


def _connect(url: str, token: str) -> GrafanaApi:
    # grafana-client appends "api" to the URL's path as is: "http://h/grafana" would become
    # "http://h/grafanaapi". A trailing slash makes it "http://h/grafana/api".
    from grafana_client import GrafanaApi  # imported on use: `pagoda` itself runs without grafana-client

    return GrafanaApi.from_url(url.rstrip("/") + "/", credential=token)


def _folder_uid(api: GrafanaApi, title: str) -> str:
    """The uid of the top-level folder called `title`, created if there is none."""
    for folder in api.folder.get_all_folders():
        if folder.get("title") == title:
            return folder["uid"]
    return api.folder.create_folder(title)["uid"]


def push_dashboard(url: str, token: str, folder: str | None = None,
                   dashboard_path: str | Path | None = None) -> dict:
    """Create or update the dashboard on the Grafana at `url` (a service account token as `token`).

    With `folder`, the dashboard goes into that folder (created if missing); without, into General.
    Returns Grafana's answer: {"id", "uid", "url", "status", "version", "slug"}.
    """
    api = _connect(url, token)
    payload = {"dashboard": load_dashboard(dashboard_path), "overwrite": True,
               "message": "pagoda grafana push"}
    if folder:
        payload["folderUid"] = _folder_uid(api, folder)
    return api.dashboard.update_dashboard(payload)


def add_grafana_args(parser: argparse.ArgumentParser) -> None:
    """Options of `pagoda grafana push`."""
    url, token = os.environ.get("GRAFANA_URL"), os.environ.get("GRAFANA_TOKEN")
    parser.add_argument("--url", default=url, required=url is None,
                        help="Grafana base URL, e.g. http://grafana:3000 (default: $GRAFANA_URL)")
    parser.add_argument("--token", default=token, required=token is None,
                        help="Grafana service account token (default: $GRAFANA_TOKEN, which keeps it "
                             "out of the process list)")
    parser.add_argument("--folder", default=None, help="folder title, created if missing (default: General)")
    parser.add_argument("--dashboard", default=None, help=f"dashboard JSON (default: {DASHBOARD_PATH})")


def run_grafana_push(args: argparse.Namespace) -> int:
    """Run `pagoda grafana push`; the process exit code."""
    try:
        result = push_dashboard(args.url, args.token, folder=args.folder, dashboard_path=args.dashboard)
    except (_grafana_exception(), OSError) as e:  # an HTTP error answer, or no connection at all
        print(f"grafana push failed: {e}", file=sys.stderr)
        return 1
    print(f"dashboard {result.get('uid')} {result.get('status')}: {args.url.rstrip('/')}{result.get('url', '')}")
    return 0


def _grafana_exception() -> type:
    from grafana_client.client import GrafanaException

    return GrafanaException
