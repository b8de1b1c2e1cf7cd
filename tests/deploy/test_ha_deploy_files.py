"""High availability on PostgreSQL: docker-compose.ha.yml and deploy/k8s-postgres, checked without
Docker or a cluster, plus one run of the replicas' real command against a real PostgreSQL.

Every coordinator runs plain ``tally serve`` with the store from the environment (a Secret on
Kubernetes): the first owns the store, the others serve at once as replicas (no ``--standby``), so
every one is probed for readiness. Each tells the others where to reach it (``TALLY_ADVERTISE_HOST``:
its Compose service name, its pod's IP) and goes by a name of its own (``TALLY_REPLICA_NAME``). The
Service and the PodDisruptionBudget select the same pods.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy
import yaml

from tally_server.settings import Settings, split_listen
from tally_server.testing import running_server
from tests.deploy.test_deploy_files import (
    GRPC_PORT,
    HTTP_PORT,
    REPO,
    STOP_MARGIN_S,
    TALLY_UID,
    compose_env,
    compose_mounts,
    container_port,
    dockerfile_stages,
    duration_s,
    interpolate,
    is_bind,
    k8s_docs,
    k8s_object,
    manifests_listed_by_kustomization,
    mounted_on_host,
    tally_settings,
)

COMPOSE_HA = REPO / "docker-compose.ha.yml"
K8S_HA = REPO / "deploy" / "k8s-postgres"
PROMETHEUS_HA = REPO / "deploy" / "prometheus" / "prometheus-ha.yml"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
REPLICAS = ("tally-1", "tally-2", "tally-3")
STORE_SECRET = "tally-store"
# What a Secret would hold; any PostgreSQL URL does for checking the settings it makes.
SAMPLE_STORE = "postgresql+psycopg://tally:secret@db.example.com:5432/tally?sslmode=require"


def compose_ha() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_HA.read_text())  # merge keys (<<: *tally) as Compose reads them
    assert isinstance(loaded, dict)
    return loaded


def replica_services() -> dict[str, dict[str, Any]]:
    services = compose_ha()["services"]
    return {name: service for name, service in services.items() if name.startswith("tally")}


def image_tally_env() -> dict[str, str]:
    return {k: v for k, v in dockerfile_stages()[-1].env().items() if k.startswith("TALLY_")}


def serve_args(command: list[str]) -> list[str]:
    """The options after ``tally serve``; the command must be exactly that program."""
    assert command[:2] == ["tally", "serve"], command
    return command[2:]


def settings_of(command: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings of ``tally serve`` started with ``command`` (the flags this deployment uses) and ``env``."""
    args = serve_args(command)
    assert "--standby" not in args, "a standby listens on no port: every replica serves now"
    assert not args, f"flags this test does not map to settings: {args}"
    return tally_settings(env, monkeypatch)


def k8s_ha_docs() -> dict[str, list[dict[str, Any]]]:
    return k8s_docs(K8S_HA)


def k8s_ha_object(kind: str, name: str | None = None) -> dict[str, Any]:
    return k8s_object(kind, name, K8S_HA)


def pod_template() -> dict[str, Any]:
    template: dict[str, Any] = k8s_ha_object("Deployment")["spec"]["template"]
    return template


def ha_container() -> dict[str, Any]:
    (container,) = pod_template()["spec"]["containers"]
    return container


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def image_tag(image: str) -> str | None:
    name = image.rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else None


# --- docker compose -------------------------------------------------------------------------------


def test_ha_compose_has_three_replicas_postgres_prometheus_and_grafana() -> None:
    services = compose_ha()["services"]
    assert set(services) == {*REPLICAS, "postgres", "prometheus", "grafana"}
    assert compose_ha()["name"] != "tally", "would share volumes and containers with docker-compose.yml"
    for name in REPLICAS:
        assert services[name]["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert services["postgres"]["image"] == "postgres:16"
    for name in ("postgres", "prometheus", "grafana"):
        check = services[name].get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_ha_compose_every_replica_serves_the_postgres_store(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose_ha()["services"]
    pg = compose_env(services["postgres"])
    expected = f"postgresql+psycopg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    replicas = replica_services()
    assert set(replicas) == set(REPLICAS)
    data_volumes = set()
    for name, service in replicas.items():
        command = service["command"]
        assert "--standby" not in command, f"{name}: a standby would listen on no port"
        assert not any(arg.startswith("--store") for arg in command), f"{name}: the password would be in ps"
        settings = settings_of(command, {**image_tally_env(), **compose_env(service)}, monkeypatch)
        assert settings.standby is False and settings.store == expected, name
        assert settings.resolved_registry_url() == expected, name
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert duration_s(service["stop_grace_period"]) >= settings.shutdown_grace_s + STOP_MARGIN_S
        # Restarted whatever the exit status: a deposed coordinator exits 0 and must come back.
        assert service["restart"] in {"always", "unless-stopped"}, name
        (volume,) = [source for source, target in compose_mounts(service) if target == str(settings.data_dir)]
        assert not is_bind(volume), name
        data_volumes.add(volume)
    assert len(data_volumes) == len(REPLICAS), "each replica needs its own data directory"
    assert len({service["hostname"] for service in replicas.values()}) == len(REPLICAS)


def test_ha_compose_replicas_are_named_and_advertise_their_service_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = compose_env(compose_ha()["x-tally"])
    for name, service in replica_services().items():
        env = compose_env(service)
        # Each service's environment is the shared one plus its own two (a plain `environment:`
        # would replace the shared map, store included, instead of adding to it).
        assert {k: v for k, v in env.items() if k in shared} == shared, name
        assert env["TALLY_REPLICA_NAME"] == name and env["TALLY_ADVERTISE_HOST"] == name, name
        settings = settings_of(service["command"], {**image_tally_env(), **env}, monkeypatch)
        assert settings.replica_name == name and settings.resolved_replica_name() == name
        # The address the other replicas forward to: the service name in the project's network, on
        # the port the image listens on (all interfaces).
        _, port = split_listen(settings.grpc_listen)
        assert settings.advertised(settings.grpc_listen, port) == f"{name}:{GRPC_PORT}", name
        _, port = split_listen(settings.http_listen)
        assert settings.advertised(settings.http_listen, port) == f"{name}:{HTTP_PORT}", name


def test_ha_compose_replicas_keep_the_image_healthcheck() -> None:
    # Every replica answers /readyz now (ready while it knows a live owner): nothing to turn off.
    assert dockerfile_stages()[-1].all("HEALTHCHECK"), "the image has a healthcheck"
    for name, service in replica_services().items():
        assert not service.get("healthcheck", {}).get("disable"), name
        assert "healthcheck" not in service, f"{name}: the image's check (GET /readyz) is the one to use"


def test_ha_compose_replicas_publish_their_ports_on_distinct_host_ports() -> None:
    published: list[str] = []
    for name, service in replica_services().items():
        targets = []
        for entry in service["ports"]:
            host, host_port, container = interpolate(entry).rsplit(":", 2)
            assert host == "127.0.0.1", f"{name}: publish on loopback unless TALLY_PUBLISH_HOST says so"
            published.append(host_port)
            targets.append(int(container))
        assert sorted(targets) == sorted([GRPC_PORT, HTTP_PORT]), name
    assert len(published) == len(set(published)), published


def test_ha_compose_bind_mounts_exist_and_named_volumes_are_declared() -> None:
    spec = compose_ha()
    declared = set(spec.get("volumes") or {})
    for name, service in spec["services"].items():
        for source, _target in compose_mounts(service):
            if is_bind(source):
                assert (REPO / source).exists(), f"{name}: {source} is missing"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"


def test_ha_prometheus_scrapes_every_replica_and_grafana_is_provisioned_as_in_compose() -> None:
    services = compose_ha()["services"]
    assert mounted_on_host(services["prometheus"], "/etc/prometheus/prometheus.yml") == PROMETHEUS_HA
    config = yaml.safe_load(PROMETHEUS_HA.read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "tally"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert sorted(targets) == sorted(f"{name}:{HTTP_PORT}" for name in REPLICAS)
    assert set(services["prometheus"]["depends_on"]) == set(REPLICAS)
    # Grafana exactly as in docker-compose.yml: the same provisioning and dashboard.
    single = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["grafana"]
    assert services["grafana"]["volumes"] == single["volumes"]
    assert compose_env(services["grafana"]) == compose_env(single)


def test_ha_compose_and_k8s_images_are_pinned() -> None:
    images = [service["image"] for service in compose_ha()["services"].values()]
    images += [c["image"] for c in pod_template()["spec"]["containers"]]
    for image in images:
        assert image_tag(image) not in {None, "latest"}, image
    (kustomization,) = k8s_ha_docs()["kustomization.yaml"]
    for override in kustomization.get("images", []):
        assert override.get("newTag") not in {None, "latest"}, override


# --- kubernetes -----------------------------------------------------------------------------------


def test_ha_k8s_manifests_parse_and_kustomization_lists_them_all() -> None:
    docs = manifests_listed_by_kustomization(K8S_HA)
    kinds = sorted(obj["kind"] for objects in docs.values() for obj in objects)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
    # The only Secret is the tokens' placeholder (test_deploy_secrets.py): the store's password
    # belongs in a Secret the operator creates, not in the repository.
    (secret,) = [obj for objects in docs.values() for obj in objects if obj["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "tally-tokens" and list(secret["stringData"]) == ["TALLY_TOKENS"]


def test_ha_k8s_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(K8S_HA)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]


def test_ha_k8s_deployment_runs_three_replicas_with_the_store_from_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deployment = k8s_ha_object("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert selects(spec["selector"]["matchLabels"], pod_template()["metadata"]["labels"])
    container = ha_container()
    command = container["command"]
    assert "--standby" not in serve_args(command), "a standby would listen on no port"
    assert not any("--store" in arg or "$(TALLY_STORE)" in arg for arg in command + container.get("args", []))
    (store,) = [e for e in container.get("env", []) if e["name"] == "TALLY_STORE"]
    ref = store["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (STORE_SECRET, "TALLY_STORE")
    assert not ref.get("optional"), "without the store the pods would not share one: fail visibly instead"
    (config_ref,) = [s["configMapRef"]["name"] for s in container["envFrom"] if "configMapRef" in s]
    config = k8s_ha_object("ConfigMap", config_ref)["data"]
    assert "TALLY_STORE" not in config and "TALLY_REGISTRY_URL" not in config
    settings = settings_of(command, {**image_tally_env(), **config, "TALLY_STORE": SAMPLE_STORE}, monkeypatch)
    assert settings.standby is False and settings.store == SAMPLE_STORE
    pod = pod_template()["spec"]
    assert pod["terminationGracePeriodSeconds"] >= settings.shutdown_grace_s + STOP_MARGIN_S
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (data,) = [name for name, path in mounts.items() if path == str(settings.data_dir)]
    assert "emptyDir" in volumes[data] or "ephemeral" in volumes[data], "a small volume of the pod's own"
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]


def test_ha_k8s_pods_advertise_their_ip_and_go_by_their_pod_name(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {e["name"]: e for e in ha_container()["env"]}
    for name, field in (("TALLY_ADVERTISE_HOST", "status.podIP"), ("TALLY_REPLICA_NAME", "metadata.name")):
        assert "value" not in env[name], name
        assert env[name]["valueFrom"] == {"fieldRef": {"fieldPath": field}}, name
    (config_ref,) = [s["configMapRef"]["name"] for s in ha_container()["envFrom"] if "configMapRef" in s]
    config = k8s_ha_object("ConfigMap", config_ref)["data"]
    assert "TALLY_ADVERTISE_HOST" not in config and "TALLY_REPLICA_NAME" not in config, "one per pod"
    # What the kubelet would put there, read as tally serve reads it.
    pod = {"TALLY_ADVERTISE_HOST": "10.1.2.3", "TALLY_REPLICA_NAME": "tally-7d9f8-abcde"}
    settings = settings_of(
        ha_container()["command"],
        {**image_tally_env(), **config, "TALLY_STORE": SAMPLE_STORE, **pod},
        monkeypatch,
    )
    assert settings.resolved_replica_name() == "tally-7d9f8-abcde"
    _, port = split_listen(settings.grpc_listen)
    assert settings.advertised(settings.grpc_listen, port) == f"10.1.2.3:{GRPC_PORT}"
    _, port = split_listen(settings.http_listen)
    assert settings.advertised(settings.http_listen, port) == f"10.1.2.3:{HTTP_PORT}"


def test_ha_k8s_update_starts_every_new_pod_before_stopping_old_ones() -> None:
    # New pods serve as replicas (ready) at once: old pods go only once new ones are ready, and all
    # new ones start together, so the store usually moves once, to a new pod.
    strategy = k8s_ha_object("Deployment")["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    rolling = strategy["rollingUpdate"]
    assert str(rolling["maxUnavailable"]) in {"0", "0%"}, rolling
    assert str(rolling["maxSurge"]) in {"100%", "3"}, rolling


def test_ha_k8s_readiness_is_readyz_on_the_http_port_and_nothing_probes_for_liveness() -> None:
    container = ha_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT}
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/readyz" and container_port(container, readiness["port"]) == HTTP_PORT
    assert readiness.get("scheme", "HTTP") == "HTTP"
    assert "livenessProbe" not in container and "startupProbe" not in container, (
        "a replica taking the store over closes its ports while it loads the journals: no kill for that"
    )


def test_ha_k8s_runs_as_the_image_user_without_privileges() -> None:
    security = pod_template()["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == security["runAsGroup"] == security["fsGroup"] == TALLY_UID
    container_security = ha_container()["securityContext"]
    assert container_security["allowPrivilegeEscalation"] is False
    assert container_security["readOnlyRootFilesystem"] is True
    assert container_security["capabilities"]["drop"] == ["ALL"]


def test_ha_k8s_service_sends_traffic_to_ready_pods_only() -> None:
    service = k8s_ha_object("Service", "tally")
    spec = service["spec"]
    assert selects(spec["selector"], pod_template()["metadata"]["labels"])
    assert not spec.get("publishNotReadyAddresses"), "a replica without a live owner cannot forward"
    assert spec.get("clusterIP") != "None"
    container = ha_container()
    ports = {p["name"]: (p["port"], container_port(container, p["targetPort"])) for p in spec["ports"]}
    assert ports == {"grpc": (GRPC_PORT, GRPC_PORT), "http": (HTTP_PORT, HTTP_PORT)}
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(HTTP_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_ha_k8s_pdb_covers_the_same_pods_and_evicts_one_at_a_time() -> None:
    pdb = k8s_ha_object("PodDisruptionBudget")
    deployment = k8s_ha_object("Deployment")
    selector = pdb["spec"]["selector"]
    assert set(selector) == {"matchLabels"}
    assert selector["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert selects(selector["matchLabels"], pod_template()["metadata"]["labels"])
    # Every pod is ready (owner and replicas): one eviction at a time leaves two serving.
    assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"].get("unhealthyPodEvictionPolicy", "IfHealthyBudget") == "IfHealthyBudget"


# --- documentation --------------------------------------------------------------------------------


def ha_section() -> str:
    text = DEPLOY_DOC.read_text()
    match = re.search(r"^## High availability on PostgreSQL\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "docs/deploy.md has no section 'High availability on PostgreSQL'"
    return match[1]


def test_deploy_doc_ha_section_names_the_files_and_links_scale_out() -> None:
    section = ha_section()
    for link in ("../docker-compose.ha.yml", "../deploy/k8s-postgres/", "scale-out.md"):
        assert f"]({link}" in section, link
    assert "docker compose -f docker-compose.ha.yml up" in section
    assert "kubectl apply -k deploy/k8s-postgres" in section
    assert f"kubectl create secret generic {STORE_SECRET}" in section
    assert "taking over store" in section and "serving as a replica" in section and "/readyz" in section
    # --standby is still an option, but no replica here uses it: mentioned only with what it does.
    for paragraph in section.split("\n\n"):
        assert "--standby" not in paragraph or "no port" in paragraph, paragraph
    for setting in ("TALLY_REPLICA_NAME", "TALLY_ADVERTISE_HOST"):
        assert setting in section, setting


def test_deploy_doc_ha_section_uses_only_real_flags_and_settings() -> None:
    section = ha_section()
    fields = set(Settings.model_fields)
    for command in re.findall(r"tally serve[^`\n]*", section):
        for flag in re.findall(r"(?<![\w-])--([a-z][a-z-]*)", command):
            name = flag.removeprefix("no-").replace("-", "_")
            assert name in fields or name == "help", f"tally serve has no --{flag}"
    client_vars = {"TALLY_ADDRESS", "TALLY_PUBLISH_HOST"}
    for var in set(re.findall(r"\bTALLY_[A-Z_]+\b", section)) - client_vars:
        assert var.removeprefix("TALLY_").lower() in fields, f"{var} is not a setting of tally serve"


# --- the replicas' command, run for real -------------------------------------------------------


@pytest.mark.postgres
def test_ha_replica_command_one_owns_the_other_serves_as_replica_then_takes_over(
    tmp_path: Path, postgres_url: str
) -> None:
    """The compose replicas' command and environment, pointed at a test database on loopback."""
    service = replica_services()[REPLICAS[0]]
    # TALLY_ADVERTISE_HOST is the Compose service name there; here the replicas reach each other on
    # loopback, where they listen.
    env = {**compose_env(service), "TALLY_STORE": postgres_url, "TALLY_ADVERTISE_HOST": "127.0.0.1"}
    args = serve_args(service["command"])
    readyz = ha_container()["readinessProbe"]["httpGet"]["path"]
    taking_over = re.compile(r"taking over store .*\(epoch (\d+)\)")
    second = {**compose_env(replica_services()[REPLICAS[1]]), "TALLY_STORE": postgres_url}
    second["TALLY_ADVERTISE_HOST"] = "127.0.0.1"
    with running_server(tmp_path / "a", settle_ms=0, env=env, args=args) as owner:
        assert httpx.get(f"{owner.http_url}{readyz}", timeout=10).status_code == 200
        first_epoch = _store_epoch(postgres_url)
        with running_server(tmp_path / "b", settle_ms=0, env=second, args=args) as replica:
            # Serving at once, as a replica: ready, and forwarding what it does not answer itself.
            assert "serving as a replica" in replica.log()
            _wait(lambda: _status(f"{replica.http_url}{readyz}") == 200, "the replica to be ready", 30)
            ready = httpx.get(f"{replica.http_url}{readyz}", timeout=10).json()
            assert ready["status"] == "ready" and ready["role"] == "replica", ready
            assert httpx.get(f"{replica.http_url}/v1/checkpoints", timeout=10).status_code == 200
            assert "tally_replica_up{" in httpx.get(f"{replica.http_url}/metrics", timeout=10).text
            assert owner.terminate() == 0
            _wait(lambda: taking_over.search(replica.log()) is not None, "the takeover", 60)
            (second_epoch,) = taking_over.findall(replica.log())
            assert int(second_epoch) == first_epoch + 1
            _wait(
                lambda: _status(f"{replica.http_url}{readyz}") == 200,
                "the new owner to be ready",
                60,
            )
            assert "tally_replica_up" not in httpx.get(f"{replica.http_url}/metrics", timeout=10).text
            assert replica.terminate() == 0


@pytest.mark.postgres
def test_ha_replicas_go_by_their_tally_replica_name(tmp_path: Path, postgres_url: str) -> None:
    service = replica_services()[REPLICAS[0]]
    env = {**compose_env(service), "TALLY_STORE": postgres_url, "TALLY_ADVERTISE_HOST": "127.0.0.1"}
    args = serve_args(service["command"])
    with (
        running_server(tmp_path / "a", env={**env, "TALLY_REPLICA_NAME": "first"}, args=args),
        running_server(tmp_path / "b", env={**env, "TALLY_REPLICA_NAME": "second"}, args=args) as replica,
    ):
        _wait(lambda: _status(f"{replica.http_url}/readyz") == 200, "the replica to be ready", 30)
        assert httpx.get(f"{replica.http_url}/readyz", timeout=10).json()["owner"] == "first"
        metrics = httpx.get(f"{replica.http_url}/metrics", timeout=10).text
        assert 'replica="second"' in metrics


def _store_epoch(url: str) -> int:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as conn:
            epoch = conn.execute(sqlalchemy.text("SELECT epoch FROM store_epoch WHERE id = 1")).scalar_one()
            return int(epoch)
    finally:
        engine.dispose()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _wait(condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
