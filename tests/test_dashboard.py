"""The Grafana dashboard (docs/grafana/*.json), proven against a real Prometheus: it scrapes two
real workers and the fleet exporter while they crawl the demo site (a 429 pauses A and lowers
its adaptive rate, D goes at its rate, B has a limit set live, C is paused live; and a third
worker, cut off from the throttle's Redis, fails its calls), then every expression of every panel is evaluated through
Prometheus's HTTP API, and each returns series (for the crawl's domains, where it has them).
Skipped where Prometheus is not installed (``.ci/run`` installs it as root)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from demo_site import HOSTS, DemoSite
from local_redis import RedisServer, free_port
from processes import TOOL, finish_crawl_workers, start_crawl_workers, wait_until
from redis_topologies import UNUSED_URL
from support import crawl_settings, pages, shared_jobs

from scrapy_redis_throttle.control import LiveControl

DASHBOARDS = sorted((Path(__file__).resolve().parent.parent / "docs" / "grafana").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
A, B, C = HOSTS
# A domain the site serves beside them, crawled steadily.
D = "127.0.0.6"
# Prometheus reads durations as 500ms, not 0.5s.
SCRAPE = "500ms"
# Grafana's variables, as a dashboard user with every domain selected sends them.
VARIABLES = {"$__rate_interval": "5s", '"$domain"': '".*"'}

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Prometheus is not installed (apt-get install prometheus; .ci/run installs it as root)",
)


def expressions() -> list[tuple[str, str]]:
    """Every (panel title, PromQL expression) of the dashboards."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend((panel["title"], target["expr"]) for target in panel.get("targets", ()))
            walk(panel.get("panels", []))

    for dashboard in DASHBOARDS:
        walk(json.loads(dashboard.read_text(encoding="utf-8"))["panels"])
    return found


def query(port: int, expression: str) -> list[dict[str, Any]]:
    for variable, value in VARIABLES.items():
        expression = expression.replace(variable, value)
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=10) as response:
        reply = json.load(response)
    assert reply["status"] == "success", (expression, reply)
    return list(reply["data"]["result"])


def answers(port: int) -> bool:
    """Whether Prometheus serves queries on *port* (it takes a moment to start)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:  # not listening yet, or not ready (503)
        return False


def test_every_panel_of_the_dashboard_shows_the_crawl(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    found = expressions()
    assert len(found) >= 10, found
    ports = [free_port() for _ in range(3)]
    exporter_port, prometheus_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # YAML takes JSON
            {
                "global": {"scrape_interval": SCRAPE},
                "scrape_configs": [
                    {
                        "job_name": "fleet",
                        "static_configs": [
                            {"targets": [f"127.0.0.1:{port}" for port in (*ports, exporter_port)]}
                        ],
                    }
                ],
            }
        ),
        encoding="utf-8",
    )
    with redis_server.client() as client:
        control = LiveControl(client, "redis_throttle")
        control.set(B, 3, None)
        control.pause(C)
    prometheus_log = (tmp_path / "prometheus.log").open("w", encoding="utf-8")
    processes = [
        subprocess.Popen(
            [
                PROMETHEUS or "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=prometheus_log,
        ),
        subprocess.Popen(
            [*TOOL, "--redis-url", redis_server.url, "exporter", "--port", str(exporter_port)],
            stdout=subprocess.DEVNULL,
        ),
    ]

    def ready() -> bool:
        if processes[0].poll() is not None:
            log = (tmp_path / "prometheus.log").read_text(encoding="utf-8")
            raise AssertionError(f"Prometheus exited: {log[-2000:]}")
        return answers(prometheus_port)

    wait_until(ready, 60, "Prometheus ready")
    errors = {(A, "*"): [(429, {"Retry-After": "30"})]}
    try:
        with DemoSite([*HOSTS, D], pages=200, errors=errors) as site:
            # A is paused by its first answer, a 429, for 30 s; D goes on at its rate.
            settings = crawl_settings(
                redis_server.url,
                REDIS_THROTTLE_REPORT_INTERVAL=0.5,
                REDIS_THROTTLE_ADAPTIVE_ENABLED=True,
            )
            jobs = shared_jobs(
                settings,
                pages(site, A, 20) + pages(site, D, 200),
                {A: "5/s", B: "5/s", D: "5/s"},
                workers=2,
            )
            cut_off = {**settings, "REDIS_THROTTLE_URL": UNUSED_URL}
            jobs.append({**jobs[0], "settings": cut_off, "requests": pages(site, D, 5, 500)})
            for job, port in zip(jobs, ports, strict=True):
                job["settings"] = {**job["settings"], "REDIS_THROTTLE_METRICS_PORT": port}
            workers = start_crawl_workers(redis_server.url, jobs)

            def seen(expression: str) -> bool:
                return bool(query(prometheus_port, expression))

            wait_until(
                lambda: seen(f'scrapy_redis_throttle_pauses_total{{domain="{A}"}}'),
                60,
                "Prometheus's scrape of A's pause",
            )
            wait_until(
                lambda: seen("scrapy_redis_throttle_redis_errors_total"),
                60,
                "Prometheus's scrape of the cut-off worker's failed calls",
            )
            empty: list[tuple[str, str]] = []

            def every_panel_shown() -> bool:
                """Whether each expression returns series, those by domain for the crawl's
                domains only (else it is noted in *empty*)."""
                empty.clear()
                for title, expression in found:
                    result = query(prometheus_port, expression)
                    domains = {series["metric"].get("domain", A) for series in result}
                    if not result or not domains <= {A, B, C, D}:
                        empty.append((title, expression))
                return not empty

            try:
                wait_until(every_panel_shown, 30, "every panel's expressions with series")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; without: {empty}") from None
            for worker in workers:
                worker.send_signal(signal.SIGINT)
            finish_crawl_workers(workers, 60)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        prometheus_log.close()
    print(f"{len(found)} expressions of {len(DASHBOARDS)} dashboard(s), each with series")
