"""Deployment files, checked as far as a machine without Docker, Kubernetes, SLURM or systemd allows.

Compose and the manifests parse and reference files that exist; the image, the StatefulSet and the
unit run the same ``tally serve`` the tests start, with probes on its real ports and paths and stop
timeouts longer than its own shutdown grace; every ``TALLY_*`` they set is a real setting with a
valid value; shell scripts pass shellcheck; and ``coordinator.sbatch`` / ``array.sbatch`` run for
real as plain bash scripts against a real coordinator.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

import tally
from tally_server import testing
from tally_server.settings import Settings, split_listen
from tally_server.testing import RunningServer

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
K8S = DEPLOY / "k8s"
SLURM = DEPLOY / "slurm"
SYSTEMD = DEPLOY / "systemd"
# Written by whoever owns deploy/prometheus and deploy/grafana; compose mounts them.
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCE = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARD_PROVIDER = DEPLOY / "grafana" / "provisioning" / "dashboards" / "tally.yml"
GRAFANA_DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tally.json"

TALLY_UID = 10001
GRPC_PORT = 50051
HTTP_PORT = 8080
# What every supervisor must allow beyond TALLY_SHUTDOWN_GRACE_S for the final flush.
STOP_MARGIN_S = 10


# --- helpers ------------------------------------------------------------------------------------


def tally_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as ``tally serve`` would build them from exactly ``env``; unknown TALLY_* fail."""
    unknown = [k for k in env if k.startswith("TALLY_") and k[6:].lower() not in Settings.model_fields]
    assert not unknown, f"not settings of tally serve (docs/configuration.md): {unknown}"
    for name in list(os.environ):
        if name.startswith("TALLY_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        pairs = [item.split("=", 1) for args in self.all("ENV") for item in shlex.split(args)]
        return dict(pairs)


def dockerfile_stages(path: Path = DOCKERFILE) -> list[Stage]:
    """Instructions per stage, continuation lines joined, comments dropped, global ARGs applied."""
    logical: list[str] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue  # Docker drops comment lines, even inside a continuation
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a line continuation"
    build_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: build_args[m[1] or m[2]], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, base))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            arg_name, _, default = args.partition("=")
            build_args[arg_name] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


def healthcheck_command(stage: Stage) -> list[str]:
    (args,) = stage.all("HEALTHCHECK")
    _options, sep, command = args.partition("CMD ")
    assert sep, "HEALTHCHECK without CMD"
    parsed = json.loads(command)
    assert isinstance(parsed, list), "HEALTHCHECK CMD must be the exec (JSON) form"
    return parsed


def run_python_healthcheck(command: list[str], http_address: str) -> subprocess.CompletedProcess[str]:
    """Run an image's ``python -c`` healthcheck here, against ``http_address`` instead of :8080."""
    assert command[:2] == ["python", "-c"], command
    code = command[2].replace(f"127.0.0.1:{HTTP_PORT}", http_address)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)


_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set in the environment: the defaults."""
    return _INTERPOLATION.sub(lambda m: m[2] or "", value)


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def compose_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each short-syntax volume entry."""
    mounts = []
    for entry in service.get("volumes", []):
        assert isinstance(entry, str), f"use the short volume syntax: {entry!r}"
        source, target = interpolate(entry).split(":")[:2]
        mounts.append((source, target))
    return mounts


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def duration_s(value: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def k8s_docs(folder: Path = K8S) -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(folder.glob("*.yaml"))
    }


def k8s_object(kind: str, name: str | None = None, folder: Path = K8S) -> dict[str, Any]:
    found = [
        doc
        for docs in k8s_docs(folder).values()
        for doc in docs
        if doc["kind"] == kind and name in (None, doc["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def tally_container() -> dict[str, Any]:
    (container,) = k8s_object("StatefulSet")["spec"]["template"]["spec"]["containers"]
    return container


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's port, number or name, as the container port number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def systemd_unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string((SYSTEMD / "tally.service").read_text())
    return parser


def env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"{path.name}: not NAME=VALUE: {line!r}"
            pairs[name] = value
    return pairs


def shell_scripts() -> list[Path]:
    scripts = []
    for path in sorted(DEPLOY.rglob("*")):
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            first = f.readline()
        if path.suffix in {".sh", ".bash", ".sbatch"} or re.match(rb"#!.*\b(ba|da|k|z)?sh\b", first):
            scripts.append(path)
    return scripts


def tally_executable() -> str:
    command = testing._command()
    if Path(command[0]).name != "tally":
        pytest.skip(f"no tally console script beside {sys.executable}; the scripts need one")
    return command[0]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def script_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """This environment without any TALLY_*, plus what the SLURM scripts need."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "SLURM"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(TALLY_DATA_DIR=str(data_dir), TALLY_BIN=tally_executable(), **extra)
    return env


@dataclass
class ScriptProcess:
    """A script started with its stdout read line by line on a thread (None marks the end)."""

    process: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    seen: list[str]

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no line starting {prefix!r} in {timeout}s; stdout: {self.seen}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"stdout closed before {prefix!r}; exit {self.process.poll()}: {self.seen}"
                )
            if line.startswith(prefix):
                return line

    def wait_for_end_of_output(self, timeout: float = 60) -> None:
        """Until stdout closes: for coordinator.sbatch, until its address publisher has finished."""
        while self.lines.get(timeout=timeout) is not None:
            pass


@contextlib.contextmanager
def started_script(script: Path, env: dict[str, str], stderr_path: Path) -> Iterator[ScriptProcess]:
    """Run ``bash script`` in its own process group, which is killed whole on the way out."""
    with open(stderr_path, "a") as stderr:
        process = subprocess.Popen(
            ["bash", str(script)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line.rstrip("\n"))
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, name=f"{script.name}-stdout", daemon=True)
    reader.start()
    try:
        yield ScriptProcess(process, lines, seen)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(60)
        # Whatever the script left running (a server it did not exec, its publisher) goes too, so
        # that a broken script fails its test instead of leaking a coordinator.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        reader.join(30)
        if not reader.is_alive():  # closing a pipe another thread is reading would block
            assert process.stdout is not None
            process.stdout.close()


# --- image ----------------------------------------------------------------------------------------


def test_image_is_multi_stage_and_the_runtime_installs_wheels_only() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    builder, runtime = stages[0], stages[-1]
    assert runtime.base == "python:3.11-slim"
    assert any("pip wheel" in run and "./client" in run and "./server" in run for run in builder.all("RUN"))
    assert not runtime.all("COPY") or all("--from=" in c for c in runtime.all("COPY"))
    (install,) = [run for run in runtime.all("RUN") if "pip install" in run]
    assert "--no-index" in install and f"from={builder.name}" in install


def test_image_builds_the_compiled_counting_core_and_fails_without_it() -> None:
    builder, runtime = dockerfile_stages()[0], dockerfile_stages()[-1]
    # setup.py's extension is optional: without a compiler the wheel would quietly lack it.
    assert any("apt-get install" in run and "gcc" in run for run in builder.all("RUN"))
    assert not any("gcc" in run for run in runtime.all("RUN"))
    (install,) = [run for run in runtime.all("RUN") if "pip install" in run]
    assert 'python -c "import tally_server._ledgercore"' in install


def test_image_runs_tally_serve_as_the_tests_do() -> None:
    runtime = dockerfile_stages()[-1]
    assert json.loads(runtime.all("CMD")[-1]) == ["tally", "serve"]
    assert runtime.all("STOPSIGNAL") == ["SIGTERM"]
    # running_server() starts the same console script, or the module behind it.
    started = testing._command()
    assert started[-1] == "serve"
    assert Path(started[0]).name == "tally" or started[-3:-1] == ["-m", "tally_server"]
    # The SDK's [cli] extra owns the `tally` script; the server adds `serve` to it by entry point.
    client = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
    server = tomllib.loads((REPO / "server" / "pyproject.toml").read_text())["project"]
    assert client["scripts"]["tally"] == "tally.cli:main"
    assert server["entry-points"]["tally.commands"]["serve"] == "tally_server.cli:register"
    assert "scripts" not in server


def test_image_runs_as_a_fixed_non_root_user_with_its_data_on_a_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime = dockerfile_stages()[-1]
    user = runtime.all("USER")[-1].split(":")[0]
    assert user not in {"root", "0"}
    setup = " ".join(runtime.all("RUN"))
    assert f"--uid {TALLY_UID}" in setup and f"--gid {TALLY_UID}" in setup
    assert f"useradd --system --uid {TALLY_UID} --gid {user} " in setup or user == str(TALLY_UID)
    assert "chown tally:tally /data" in setup
    settings = tally_settings({k: v for k, v in runtime.env().items() if k.startswith("TALLY_")}, monkeypatch)
    assert str(settings.data_dir) == "/data"
    assert json.loads(runtime.all("VOLUME")[-1]) == ["/data"]
    assert split_listen(settings.grpc_listen) == ("0.0.0.0", GRPC_PORT)
    assert split_listen(settings.http_listen) == ("0.0.0.0", HTTP_PORT)
    assert sorted(int(p) for args in runtime.all("EXPOSE") for p in args.split()) == [HTTP_PORT, GRPC_PORT]


def test_image_healthcheck_asks_readyz_with_the_standard_library(server: RunningServer) -> None:
    command = healthcheck_command(dockerfile_stages()[-1])
    assert command[0] == "python" and f"http://127.0.0.1:{HTTP_PORT}/readyz" in command[2]
    assert run_python_healthcheck(command, server.http_address).returncode == 0
    assert run_python_healthcheck(command, f"127.0.0.1:{closed_port()}").returncode != 0


def dockerignore_excludes(path: str) -> bool:
    """Whether BuildKit leaves ``path`` out of the context, per deploy/Dockerfile.dockerignore."""
    excluded = False
    for raw in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        regex = ""
        rest = pattern.lstrip("!").strip("/")
        while rest:
            if rest.startswith("**/"):
                regex, rest = regex + "(?:.*/)?", rest[3:]
            elif rest.startswith("**"):
                regex, rest = regex + ".*", rest[2:]
            elif rest[0] == "*":
                regex, rest = regex + "[^/]*", rest[1:]
            elif rest[0] == "?":
                regex, rest = regex + "[^/]", rest[1:]
            else:
                regex, rest = regex + re.escape(rest[0]), rest[1:]
        parts = path.split("/")
        # A pattern that matches a directory covers everything inside it.
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negated
    return excluded


def test_build_context_sends_the_sources_and_nothing_else() -> None:
    copied = [args.split()[0] for args in dockerfile_stages()[0].all("COPY")]
    assert copied == ["client", "server", "deploy/constraints.txt"]
    for source in copied[:2]:
        assert (REPO / source / "pyproject.toml").exists()
    assert (REPO / copied[2]).is_file()
    for sent in [
        "client/pyproject.toml",
        "client/src/tally/__init__.py",
        "server/src/tally_server/cli.py",
        "deploy/constraints.txt",
    ]:
        assert not dockerignore_excludes(sent), sent
    for left_out in [
        ".env",
        "deploy/k8s/secret-tokens.yaml",
        ".venv/bin/python",
        "tally-data/registry.sqlite3",
        "tests/conftest.py",
        ".git/HEAD",
        ".mypy_cache/3.11/x.json",
        "server/src/tally_server/__pycache__/cli.cpython-311.pyc",
        "client/.venv/bin/python",
        "server/tally-data/checkpoints/x",
    ]:
        assert dockerignore_excludes(left_out), left_out


# --- docker compose -------------------------------------------------------------------------------


def test_compose_has_the_four_services_each_with_a_healthcheck() -> None:
    services = compose()["services"]
    assert set(services) == {"tally", "postgres", "prometheus", "grafana"}
    for name, service in services.items():
        check = service.get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
    assert services["postgres"]["image"] == "postgres:16"
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert "/api/health" in " ".join(services["grafana"]["healthcheck"]["test"])


def test_compose_builds_tally_from_the_image_and_keeps_its_healthcheck(server: RunningServer) -> None:
    tally_service = compose()["services"]["tally"]
    assert tally_service["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert (REPO / tally_service["build"]["dockerfile"]).is_file()
    test = tally_service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:] == healthcheck_command(dockerfile_stages()[-1])
    assert run_python_healthcheck(test[1:], server.http_address).returncode == 0


def test_compose_tally_uses_the_postgres_service_and_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose()["services"]
    tally_service, postgres = services["tally"], services["postgres"]
    image_env = {k: v for k, v in dockerfile_stages()[-1].env().items() if k.startswith("TALLY_")}
    settings = tally_settings({**image_env, **compose_env(tally_service)}, monkeypatch)
    url = settings.registry_url or ""
    pg = compose_env(postgres)
    expected = f"postgresql+psycopg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    assert url == expected
    assert tally_service["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert duration_s(tally_service["stop_grace_period"]) >= settings.shutdown_grace_s + STOP_MARGIN_S
    assert ("tally-data", str(settings.data_dir)) in compose_mounts(tally_service)


def test_compose_bind_mounts_exist_and_named_volumes_are_declared() -> None:
    spec = compose()
    declared = set(spec.get("volumes") or {})
    missing = []
    for name, service in spec["services"].items():
        for source, _target in compose_mounts(service):
            if is_bind(source):
                if not (REPO / source).exists():
                    missing.append(f"{name}: {source}")
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
    assert not missing, f"bind-mounted paths missing from the repository: {missing}"


def mounted_on_host(service: dict[str, Any], container_path: str) -> Path | None:
    """The repository file a container path of ``service`` comes from, through a bind mount."""
    for source, target in compose_mounts(service):
        if is_bind(source) and (container_path == target or container_path.startswith(target + "/")):
            return REPO / source / container_path[len(target) :].lstrip("/")
    return None


def test_compose_mounts_prometheus_and_grafana_provisioning_at_the_agreed_paths() -> None:
    services = compose()["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert mounted_on_host(prometheus, "/etc/prometheus/prometheus.yml") == PROMETHEUS_CONFIG
    provisioning = "/etc/grafana/provisioning"
    assert mounted_on_host(grafana, f"{provisioning}/datasources/prometheus.yml") == GRAFANA_DATASOURCE
    assert mounted_on_host(grafana, f"{provisioning}/dashboards/tally.yml") == GRAFANA_DASHBOARD_PROVIDER
    env = compose_env(grafana)
    assert mounted_on_host(grafana, env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]) == GRAFANA_DASHBOARD
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_prometheus_config_scrapes_the_compose_tally_service() -> None:
    if not PROMETHEUS_CONFIG.exists():
        pytest.skip(f"{PROMETHEUS_CONFIG.relative_to(REPO)} is not written yet")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = [
        target
        for job in config.get("scrape_configs", [])
        for static in job.get("static_configs", [])
        for target in static.get("targets", [])
    ]
    assert f"tally:{HTTP_PORT}" in targets


def test_grafana_provisioning_points_at_compose_paths_and_services() -> None:
    if not (GRAFANA_DATASOURCE.exists() and GRAFANA_DASHBOARD_PROVIDER.exists()):
        pytest.skip("deploy/grafana/provisioning is not written yet")
    grafana = compose()["services"]["grafana"]
    datasources = yaml.safe_load(GRAFANA_DATASOURCE.read_text())["datasources"]
    assert any("prometheus:9090" in source.get("url", "") for source in datasources)
    providers = yaml.safe_load(GRAFANA_DASHBOARD_PROVIDER.read_text())["providers"]
    paths = [provider["options"]["path"] for provider in providers]
    assert any(mounted_on_host(grafana, p) == GRAFANA_DASHBOARD.parent for p in paths), paths


# --- kubernetes -----------------------------------------------------------------------------------


def manifests_listed_by_kustomization(folder: Path = K8S) -> dict[str, list[dict[str, Any]]]:
    """The folder's manifests, checked to parse and to be exactly what its kustomization lists."""
    docs = k8s_docs(folder)
    for name, objects in docs.items():
        assert objects, f"{name} is empty"
        for obj in objects:
            assert obj.get("apiVersion") and obj.get("kind"), name
            assert obj["kind"] == "Kustomization" or obj["metadata"]["name"], name
    (kustomization,) = docs.pop("kustomization.yaml")
    resources = kustomization["resources"]
    assert all((folder / resource).is_file() for resource in resources)
    assert sorted(resources) == sorted(docs)
    return docs


def test_k8s_manifests_parse_and_kustomization_lists_them_all() -> None:
    manifests_listed_by_kustomization()


def test_k8s_statefulset_runs_one_coordinator_on_its_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    statefulset = k8s_object("StatefulSet")
    spec = statefulset["spec"]
    assert spec["replicas"] == 1
    pod = spec["template"]["spec"]
    container = tally_container()
    assert container.get("command", ["tally", "serve"]) == ["tally", "serve"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (claim,) = spec["volumeClaimTemplates"]
    image_env = dockerfile_stages()[-1].env()
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == image_env["TALLY_DATA_DIR"]
    assert claim["spec"]["accessModes"] in (["ReadWriteOnce"], ["ReadWriteOncePod"])
    headless = k8s_object("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # The settings the pod gets: the image's, then the ConfigMap's.
    (config_ref,) = [s["configMapRef"]["name"] for s in container["envFrom"] if "configMapRef" in s]
    config = k8s_object("ConfigMap", config_ref)["data"]
    settings = tally_settings(
        {**{k: v for k, v in image_env.items() if k.startswith("TALLY_")}, **config}, monkeypatch
    )
    assert pod["terminationGracePeriodSeconds"] >= settings.shutdown_grace_s + STOP_MARGIN_S
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]


def test_k8s_probes_target_readyz_and_grpc_health() -> None:
    container = tally_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT}
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/readyz" and container_port(container, readiness["port"]) == HTTP_PORT
    for probe in ("livenessProbe", "startupProbe"):
        grpc_probe = container[probe]["grpc"]
        assert container_port(container, grpc_probe["port"]) == GRPC_PORT
        assert grpc_probe.get("service", "") in {"", "tally.v1.Coordinator"}


def test_k8s_runs_as_the_image_user_without_privileges() -> None:
    pod = k8s_object("StatefulSet")["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == security["runAsGroup"] == security["fsGroup"] == TALLY_UID
    container_security = tally_container()["securityContext"]
    assert container_security["allowPrivilegeEscalation"] is False
    assert container_security["capabilities"]["drop"] == ["ALL"]


def test_k8s_service_exposes_both_ports_and_asks_to_be_scraped() -> None:
    service = k8s_object("Service", "tally")
    pod_labels = k8s_object("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container = tally_container()
    ports = {
        p["name"]: (p["port"], container_port(container, p["targetPort"])) for p in service["spec"]["ports"]
    }
    assert ports == {"grpc": (GRPC_PORT, GRPC_PORT), "http": (HTTP_PORT, HTTP_PORT)}
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(HTTP_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


# --- systemd --------------------------------------------------------------------------------------


def test_systemd_unit_runs_tally_serve_hardened(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = systemd_unit()
    service = unit["Service"]
    assert service["Type"] == "simple"
    assert service["User"] == "tally"
    assert service["ExecStart"] == "/opt/tally/venv/bin/tally serve"
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] in {"yes", "true", "on", "1"}
    assert service["PrivateTmp"] in {"yes", "true", "on", "1"}
    assert service["ProtectSystem"] == "strict"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert service["EnvironmentFile"].lstrip("-") == "/etc/tally/tally.env"
    settings = tally_settings(env_file(SYSTEMD / "tally.env"), monkeypatch)
    assert str(settings.data_dir) in service["ReadWritePaths"].split()
    assert duration_s(service["TimeoutStopSec"] + ("s" if service["TimeoutStopSec"].isdigit() else "")) >= (
        settings.shutdown_grace_s + STOP_MARGIN_S
    )


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this environment's tally.
    unit = tmp_path / "tally.service"
    text = (SYSTEMD / "tally.service").read_text()
    unit.write_text(text.replace("/opt/tally/venv/bin/tally", tally_executable()))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "tally.service" in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


# --- shell scripts --------------------------------------------------------------------------------


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shell_script_passes_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        message = "shellcheck is not installed (Debian/Ubuntu: apt-get install -y shellcheck)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run it")
        pytest.skip(message)
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_slurm_scripts_are_found_for_shellcheck() -> None:
    assert {SLURM / "coordinator.sbatch", SLURM / "array.sbatch"} <= set(shell_scripts())


# --- slurm, run for real as plain bash ------------------------------------------------------------


@pytest.mark.parametrize(
    ("grpc_listen", "advertise_host"),
    [("127.0.0.1:0", None), ("0.0.0.0:0", "127.0.0.1")],
    ids=["loopback", "all-interfaces-advertised"],
)
def test_coordinator_sbatch_publishes_its_address_serves_and_stops_cleanly(
    tmp_path: Path, grpc_listen: str, advertise_host: str | None
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    address_file = data / "coordinator.address"
    # Left by a coordinator that was killed: nothing answers there, so it must be replaced.
    address_file.write_text(f"127.0.0.1:{closed_port()}\n")
    extra = {"TALLY_GRPC_LISTEN": grpc_listen, "TALLY_HTTP_LISTEN": "127.0.0.1:0"}
    if advertise_host:
        extra["TALLY_ADVERTISE_HOST"] = advertise_host
    with started_script(SLURM / "coordinator.sbatch", script_env(data, **extra), tmp_path / "stderr") as job:
        listening = job.wait_for("grpc listening on ")
        job.wait_for("coordinator.sbatch: published ")
        port = listening.rsplit(":", 1)[1]
        address = address_file.read_text()
        assert address == f"{advertise_host or '127.0.0.1'}:{port}\n"
        with tally.Client(address.strip()) as client:
            assert client.are_completed("x", ["a"]) == [False]

        job.process.send_signal(signal.SIGTERM)
        assert job.process.wait(60) == 0, (tmp_path / "stderr").read_text()
        job.wait_for_end_of_output()
    assert not address_file.exists(), "a stopped coordinator's address must be withdrawn"
    assert "shutdown complete" in (tmp_path / "stderr").read_text()


def test_array_tasks_run_the_worker_with_the_coordinator_address(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = script_env(data, TALLY_GRPC_LISTEN="127.0.0.1:0", TALLY_HTTP_LISTEN="127.0.0.1:0")
    with started_script(SLURM / "coordinator.sbatch", env, tmp_path / "stderr") as job:
        job.wait_for("coordinator.sbatch: published ")
        address = (data / "coordinator.address").read_text().strip()
        # The default WORKER_CMD, "python worker.py", run in the submission directory.
        work = tmp_path / "work"
        work.mkdir()
        (work / "worker.py").write_text(
            "import json, os, sys, tally\n"
            "with tally.Client() as client:\n"
            "    done = client.are_completed('x', ['a'])\n"
            "report = {'address': os.environ['TALLY_ADDRESS'], 'argv': sys.argv[1:], 'done': done}\n"
            "print(json.dumps(report))\n"
        )
        task_env = {**env, "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "3"}
        for worker_cmd, argv in [
            (None, []),
            ('python worker.py --shard "$SLURM_ARRAY_TASK_ID"', ["--shard", "3"]),
        ]:
            run_env = {**task_env, **({"WORKER_CMD": worker_cmd} if worker_cmd else {})}
            result = subprocess.run(
                ["bash", str(SLURM / "array.sbatch")],
                cwd=work,
                env=run_env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, result.stdout + result.stderr
            report = json.loads(result.stdout.splitlines()[-1])
            assert report == {"address": address, "argv": argv, "done": [False]}


def test_array_task_gives_up_when_no_coordinator_publishes(tmp_path: Path) -> None:
    env = script_env(tmp_path / "nowhere", TALLY_ADDRESS_WAIT_S="0")
    result = subprocess.run(
        ["bash", str(SLURM / "array.sbatch")], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "no coordinator address" in result.stderr


def test_a_second_coordinator_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = script_env(data, TALLY_GRPC_LISTEN="127.0.0.1:0", TALLY_HTTP_LISTEN="127.0.0.1:0")
    with started_script(SLURM / "coordinator.sbatch", env, tmp_path / "stderr") as job:
        job.wait_for("coordinator.sbatch: published ")
        address = (data / "coordinator.address").read_text()
        second = subprocess.run(
            ["bash", str(SLURM / "coordinator.sbatch")], env=env, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1
        assert "one process per data dir" in second.stderr
        assert (data / "coordinator.address").read_text() == address
        assert job.process.poll() is None


# --- documentation --------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", ["docs/deploy.md", "deploy/slurm/README.md"])
def test_deployment_docs_link_to_files_that_exist(doc: str) -> None:
    path = REPO / doc
    links = re.findall(r"\]\(([^)#\s]+)", path.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative or doc != "docs/deploy.md"
    assert [link for link in relative if not (path.parent / link).exists()] == []
