"""deploy/prometheus and deploy/grafana: they parse, fit together, and query only metrics Tally exports.

The alert rules are checked and unit-tested by promtool (tests/deploy/prometheus/tally-alerts.test.yml).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import tally
from tally_server.testing import RunningServer
from tests.conftest import REPO, system_tool
from tests.integration.workload import tree

DEPLOY = REPO / "deploy"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
PROMETHEUS_HA = DEPLOY / "prometheus" / "prometheus-ha.yml"
ALERTS = DEPLOY / "prometheus" / "tally-alerts.yml"
ALERT_TESTS = REPO / "tests" / "deploy" / "prometheus" / "tally-alerts.test.yml"
DATASOURCE = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDER = DEPLOY / "grafana" / "provisioning" / "dashboards" / "tally.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tally.json"

CHECKPOINT_FILTER = 'checkpoint=~"$checkpoint"'
# Everything in an expression that looks like a name but is PromQL itself.
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "group",
    "rate", "irate", "increase", "delta", "deriv", "histogram_quantile", "clamp_min", "clamp_max",
    "abs", "ceil", "floor", "round", "time", "vector", "scalar", "label_replace", "absent",
    "and", "or", "unless", "offset", "bool", "inf", "nan",
    "by", "without", "on", "ignoring", "group_left", "group_right",
}  # fmt: skip


def load_yaml(path: Path) -> Any:
    assert path.is_file(), f"{path.relative_to(REPO)} is missing"
    return yaml.safe_load(path.read_text())


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label matchers, groupings, ranges and strings removed)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\$\w+", "", bare)
    return {t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if t not in PROMQL_WORDS}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # inside collapsed rows


def expressions(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    for var in board.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        # label_values(metric{...}, label) selects metric.
        exprs += re.findall(r"label_values\((.*),\s*\w+\)", text)
    return exprs


def test_prometheus_scrapes_tally_http_port_every_15s() -> None:
    config = load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    tally_job = jobs["tally"]
    assert tally_job.get("metrics_path", "/metrics") == "/metrics"
    assert tally_job.get("scrape_interval", config["global"]["scrape_interval"]) == "15s"
    targets = [t for group in tally_job["static_configs"] for t in group["targets"]]
    assert targets == ["tally:8080"]


def alert_rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for group in load_yaml(ALERTS)["groups"] for r in group["rules"]}


def promtool(*args: str) -> None:
    result = subprocess.run(
        [system_tool("promtool", "prometheus"), *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("config", [PROMETHEUS, PROMETHEUS_HA], ids=lambda p: p.name)
def test_prometheus_configs_load_the_alert_rules(config: Path) -> None:
    assert load_yaml(config)["rule_files"] == [ALERTS.name]
    assert ALERTS.parent == config.parent  # rule_files are relative to the config file
    promtool("check", "config", str(config))  # checks the rule files it names too


def test_the_alert_rules_pass_promtool_check_rules() -> None:
    promtool("check", "rules", str(ALERTS))


def test_the_alert_rules_pass_their_unit_tests() -> None:
    promtool("test", "rules", str(ALERT_TESTS))


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    tests = load_yaml(ALERT_TESTS)
    assert tests["rule_files"] == [str(Path("..", "..", "..", ALERTS.relative_to(REPO)))]
    cases = [case for test in tests["tests"] for case in test["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    rules = alert_rules()
    assert {
        "TallyCoordinatorDown", "TallyNotReady", "TallyAnomaliesRising", "TallyWritersExpiring",
        "TallyCommitLatencyHigh", "TallyCommitsFailing", "TallyDiskNearlyFull", "TallyStoreLeaseRenewalSlow",
    } == set(rules)  # fmt: skip
    assert fired == set(rules) and quiet == set(rules)
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_compose_mounts_the_alert_rules_beside_the_prometheus_config() -> None:
    for file in ("docker-compose.yml", "docker-compose.ha.yml"):
        volumes = load_yaml(REPO / file)["services"]["prometheus"]["volumes"]
        assert "./deploy/prometheus/tally-alerts.yml:/etc/prometheus/tally-alerts.yml:ro" in volumes, file


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard_folder() -> None:
    datasources = load_yaml(DATASOURCE)["datasources"]
    assert [(d["uid"], d["type"], d["url"]) for d in datasources] == [
        ("prometheus", "prometheus", "http://prometheus:9090")
    ]
    providers = load_yaml(PROVIDER)["providers"]
    assert [(p["type"], p["options"]["path"]) for p in providers] == [("file", "/var/lib/grafana/dashboards")]


def test_compose_mounts_the_monitoring_files_that_exist() -> None:
    compose = load_yaml(REPO / "docker-compose.yml")
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                mounts[target] = REPO / source
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    # Grafana loads what the provider's path holds: the dashboard must be in the mounted folder.
    assert DASHBOARD.parent == mounts["/var/lib/grafana/dashboards"].resolve()


def test_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    board = dashboard()
    assert board["uid"] and board["title"]
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    graphs = [p for p in panels(board) if p["type"] != "row"]
    assert len(graphs) >= 8
    for panel in graphs:
        assert panel["title"] and panel["targets"], panel.get("title")
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
    for expr in expressions(board):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def datasources(board: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every data source reference in the dashboard: of panels, their targets and the variables."""
    for panel in panels(board):
        if "datasource" in panel:
            yield panel["title"], panel["datasource"]
        for target in panel.get("targets", []):
            yield f"{panel['title']} {target['refId']}", target.get("datasource")
    for var in board["templating"]["list"]:
        if var["type"] != "datasource":
            yield f"${var['name']}", var.get("datasource")


def test_dashboard_picks_its_datasource_with_a_variable() -> None:
    board = dashboard()
    variables = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert [(v["name"], v["query"]) for v in variables] == [("datasource", "prometheus")]
    refs = list(datasources(board))
    assert len(refs) > 20
    for where, ref in refs:
        assert ref == {"type": "prometheus", "uid": "${datasource}"}, f"{where}: {ref}"


def unfiltered_selectors(expr: str, names: set[str]) -> list[str]:
    """Selectors in ``expr`` of the metrics ``names`` that do not filter by ``$checkpoint``."""
    return [
        m.group(0)
        for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?", expr)
        if m.group(1) in names and CHECKPOINT_FILTER not in (m.group(2) or "")
    ]


def test_dashboard_shows_what_an_operator_needs() -> None:
    used = set().union(*(metric_names(e) for e in expressions(dashboard())))
    for name in (
        "tally_completions_total",
        "tally_deltas_total",
        "tally_pending_sources",
        "tally_live_writers",
        "tally_anomalies_total",
        "tally_grpc_request_duration_seconds_bucket",
        "tally_http_request_duration_seconds_bucket",
        "tally_store_commit_duration_seconds_bucket",
        "tally_store_commit_batch_sources_bucket",
    ):
        assert name in used, f"the dashboard does not plot {name}"


@pytest.fixture
def exposition(server: RunningServer) -> list[Sample]:
    """Samples a live server exports once both transports, the store and a declaration were used."""
    for address in (server.grpc_address, server.http_url):
        with tally.Client(address) as client, client.writer("monitoring/names") as w:
            w.apply_deltas(tree(address))
            w.flush()
    with tally.Client(server.grpc_address) as client:
        client.declare("monitoring/declared", ["a", "b"])
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.fixture
def exported(exposition: list[Sample]) -> set[str]:
    """Sample names a live server exports."""
    return {s.name for s in exposition}


def test_every_metric_in_the_dashboard_is_exported_by_the_server(exported: set[str]) -> None:
    board = dashboard()
    exprs = expressions(board)
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        assert names <= exported, f"{sorted(names - exported)} in {expr!r} are not exported"


def test_panels_of_per_checkpoint_metrics_filter_by_the_checkpoint_variable(
    exposition: list[Sample],
) -> None:
    per_checkpoint = {s.name for s in exposition if "checkpoint" in s.labels}
    # What the server labels by checkpoint (a renamed or newly labelled metric shows up here).
    assert {"tally_completions_total", "tally_anomalies_total", "tally_declared_sources"} <= per_checkpoint
    board = dashboard()
    checked = 0
    for panel in panels(board):
        for target in panel.get("targets", []):
            used = metric_names(target["expr"]) & per_checkpoint
            checked += bool(used)
            missing = unfiltered_selectors(target["expr"], per_checkpoint)
            assert not missing, f"{panel['title']} {target['refId']}: {missing} ignore $checkpoint"
    assert checked >= 8


def test_unfiltered_selector_detection() -> None:
    names = {"tally_completions_total", "tally_live_writers"}
    expr = (
        'sum(rate(tally_completions_total{instance=~"$instance"}[5m])) / '
        'sum(tally_live_writers{checkpoint=~"$checkpoint"}) + sum(tally_live_writers)'
    )
    assert unfiltered_selectors(expr, names) == [
        'tally_completions_total{instance=~"$instance"}',
        "tally_live_writers",
    ]


# Exported only by the owner of a PostgreSQL store (test_pg_replicas reads them on a live owner).
PG_OWNER_ONLY = {"tally_store_lease_renew_seconds_bucket"}


def test_every_metric_in_the_alert_rules_is_exported_by_the_server(exported: set[str]) -> None:
    for name, rule in alert_rules().items():
        names = metric_names(rule["expr"])
        assert names, name
        names -= {"up"} | PG_OWNER_ONLY  # Prometheus's own; a PostgreSQL store's owner's
        assert names <= exported, f"{sorted(names - exported)} in {name} are not exported"


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, method) (rate(tally_grpc_request_duration_seconds_bucket"
        '{instance=~"$instance", code!="OK"}[$__rate_interval]))) / on (method) group_left max(up)'
    )
    assert metric_names(expr) == {"tally_grpc_request_duration_seconds_bucket", "up"}
