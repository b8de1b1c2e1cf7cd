"""The Grafana dashboard's queries, run by a real Prometheus that scrapes a real ``tally serve``.

No Grafana server can be installed on these machines (it is in no package registry they reach), so
this does what Grafana would do with the dashboard and checks what it would show: Prometheus starts
from the shipped ``deploy/prometheus/prometheus.yml`` (its target and intervals rewritten for a test)
with the shipped alert rules, scrapes a server that has done real work over gRPC and HTTP, and then

- each template variable's ``label_values(...)`` query is resolved through Prometheus's series API,
  as Grafana's Prometheus data source does, and must offer the server's instance and checkpoints;
- every panel's every query is run over the last minute with the variables substituted as Grafana
  does (multi-value variables as a regex alternation, ``$__rate_interval``, ``$__range``): each must
  be valid PromQL, and each must draw something unless its metric only exists once something went
  wrong (an anomaly, a refusal, a failure, an expiry);
- every alert rule evaluates without error.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import tally
from tally_server.testing import RunningServer
from tests.conftest import free_ports, system_tool
from tests.deploy.test_monitoring_files import ALERTS, PROMETHEUS, dashboard, panels
from tests.integration.workload import tree
from tests.polling import wait_until

CHECKPOINTS = ("grafana/grpc", "grafana/http")
# What a panel may leave empty on a healthy run: metrics that get their first series when something
# goes wrong. A panel outside this list without data is broken (a wrong name, label or filter).
QUIET_WHEN_HEALTHY = re.compile(r"\btally_(anomalies_total|writers_expired_total|deltas_refused_total)\b")


@pytest.fixture
def prometheus(server: RunningServer, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus on the shipped config and rules, scraping ``server`` every second."""
    binary = system_tool("prometheus", "prometheus")
    config = yaml.safe_load(PROMETHEUS.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [server.http_address]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    (port,) = free_ports(1)
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _query(prometheus: str, path: str, **params: Any) -> Any:
    reply = httpx.get(f"{prometheus}/api/v1/{path}", params=params, timeout=10).json()
    assert reply["status"] == "success", f"{path} {params}: {reply}"
    return reply["data"]


def _label_values(prometheus: str, query: str, variables: dict[str, str]) -> list[str]:
    """What Grafana offers for ``label_values(selector, label)``: the label's values over the series."""
    found = re.fullmatch(r"label_values\((.+), *(\w+)\)", query)
    assert found, f"not a label_values query: {query}"
    selector = _substitute(found.group(1), variables)
    series = _query(prometheus, "series", **{"match[]": selector})
    return sorted({s[found.group(2)] for s in series if found.group(2) in s})


def _substitute(expr: str, variables: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", "4s").replace("$__range", "1m")
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"a variable Grafana would fill is left: {expr}"
    return expr


def _work(server: RunningServer) -> None:
    """Completions, deltas, a declaration and status reads over both transports."""
    for address, checkpoint in zip((server.grpc_address, server.http_url), CHECKPOINTS, strict=True):
        with tally.Client(address) as client:
            client.declare(checkpoint, ["a", "b", "c"])
            with client.writer(checkpoint) as writer:
                writer.apply_deltas(tree("a") + tree("b"))
                writer.flush()
            client.checkpoint(checkpoint)


def test_every_dashboard_query_runs_on_a_real_prometheus_and_draws_the_servers_data(
    server: RunningServer, prometheus: str
) -> None:
    _work(server)

    def scraped_twice_after_the_work() -> bool:
        data = _query(
            prometheus,
            "query",
            query='count_over_time(tally_completed_sources{checkpoint="grafana/http"}[1m])',
        )
        return bool(data["result"]) and float(data["result"][0]["value"][1]) >= 3

    wait_until(scraped_twice_after_the_work, timeout=60, what="Prometheus to scrape the server's work")
    board = dashboard()
    variables: dict[str, str] = {}
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        values = _label_values(prometheus, query, variables)
        if var["name"] == "instance":
            assert server.http_address in values, values
        if var["name"] == "checkpoint":
            assert set(CHECKPOINTS) <= set(values), values
        # Grafana's "All" of a multi-value variable: the values as one regex alternation, each
        # escaped for a regex inside a PromQL string (a backslash doubled).
        variables[var["name"]] = "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in values) + ")"
    assert set(variables) == {"instance", "checkpoint"}

    end = float(_query(prometheus, "query", query="time()")["result"][1])
    empty: list[str] = []
    ran = 0
    for panel in panels(board):
        for target in panel.get("targets", []):
            expr = _substitute(target["expr"], variables)
            data = _query(prometheus, "query_range", query=expr, start=end - 60, end=end, step="2s")
            ran += 1
            if not data["result"] and not QUIET_WHEN_HEALTHY.search(expr):
                empty.append(f"{panel['title']} {target['refId']}: {expr}")
    assert ran >= 25
    assert not empty, "panels that draw nothing after real work:\n" + "\n".join(empty)


def test_the_shipped_alert_rules_evaluate_without_error_on_live_data(
    server: RunningServer, prometheus: str
) -> None:
    _work(server)

    def evaluated() -> bool:
        groups = _query(prometheus, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return (
            bool(rules)
            and all(r.get("lastEvaluation", "").startswith("20") for r in rules)
            and all(r["health"] != "unknown" for r in rules)
        )

    wait_until(evaluated, timeout=60, what="Prometheus to evaluate every alert rule")
    rules = [r for g in _query(prometheus, "rules")["groups"] for r in g["rules"]]
    shipped = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == shipped
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # A healthy server that Prometheus can reach fires nothing.
    assert [r["name"] for r in rules if r["state"] == "firing"] == []
