"""A real Prometheus for the tests (Debian's `prometheus` package; .ci/run installs it) and the Grafana dashboard's
PromQL asked of it the way Grafana asks: range queries.

It scrapes every 2 s with a 2 s timeout. A scrape of the Ray node can still outlast that on a loaded machine, and
Prometheus then marks every series of the target stale: an instant query right after finds no gauge (rates keep
their window's samples). A panel's range query still finds the scrapes before and after.
"""

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from tests.ports import free_port


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


@contextlib.contextmanager
def running_prometheus(target: str, root) -> Iterator[str]:
    """A Prometheus on loopback scraping `target` (host:port of a metrics endpoint); its HTTP API's base URL."""
    (root / "prometheus.yml").write_text(
        "global: {scrape_interval: 2s, scrape_timeout: 2s}\nscrape_configs:\n- job_name: ray\n"
        f"  static_configs: [{{targets: ['{target}']}}]\n")
    port = free_port()
    process = subprocess.Popen(
        ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def query(base: str, expr: str) -> dict:
    """An instant query's answer (raises OSError while Prometheus is starting)."""
    return _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def dashboard_queries(repo, models: str) -> list[str]:
    dashboard = json.loads((repo / "deploy" / "grafana" / "pagoda.json").read_text())
    return [t["expr"].replace("$model_name", models) for p in dashboard["panels"] for t in p.get("targets", [])]


def empty_dashboard_queries(base: str, repo, models: str, skip: set[str] = frozenset(), window_s: float = 60):
    """The dashboard's queries, with the models' regex for $model_name, that find no series at any point (a second
    apart) of the last window_s; a query naming a metric in `skip` is left out. A query Prometheus refuses fails."""
    end = time.time()
    empty = []
    for expr in dashboard_queries(repo, models):
        if any(name in expr for name in skip):
            continue
        params = {"query": expr, "start": f"{end - window_s:.3f}", "end": f"{end:.3f}", "step": "1"}
        answer = _get(f"{base}/api/v1/query_range?" + urllib.parse.urlencode(params))
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        if not answer["data"]["result"]:
            empty.append(expr)
    return empty


def scrape_health(base: str) -> str:
    """The share of successful scrapes in the last 5 minutes, for a failure's message."""
    answer = query(base, 'sum_over_time(up{job="ray"}[5m]) / count_over_time(up{job="ray"}[5m])')
    return f"share of successful scrapes: {[r['value'][1] for r in answer['data']['result']]}"
