"""Tokens reach the coordinator from a secret in every deployment (issue #13, item 3).

Kubernetes: a Secret ``tally-tokens`` whose ``TALLY_TOKENS`` each manifest's container reads with
``valueFrom.secretKeyRef``; its placeholder is refused by ``tally serve`` (so an unedited Secret
never means a published token works). Compose: ``TALLY_TOKENS`` comes from ``.env``, which git
ignores, and ``.env.example`` documents every variable the compose files read.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tests.deploy.test_deploy_files import (
    _INTERPOLATION,
    manifests_listed_by_kustomization,
    tally_settings,
)

REPO = Path(__file__).resolve().parents[2]
K8S_FOLDERS = [REPO / "deploy" / "k8s", REPO / "deploy" / "k8s-postgres"]
COMPOSE_FILES = [REPO / "docker-compose.yml", REPO / "docker-compose.ha.yml"]
ENV_EXAMPLE = REPO / ".env.example"


def tally_containers(folder: Path) -> list[dict[str, Any]]:
    workloads = [
        obj
        for objects in manifests_listed_by_kustomization(folder).values()
        for obj in objects
        if obj["kind"] in ("StatefulSet", "Deployment")
    ]
    assert workloads, folder
    return [c for w in workloads for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "tally"]


@pytest.mark.parametrize("folder", K8S_FOLDERS, ids=lambda p: p.name)
def test_k8s_reads_tally_tokens_from_the_tokens_secret(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = manifests_listed_by_kustomization(folder)  # the Secret is among what kustomize applies
    (secret,) = [o for objects in docs.values() for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "tally-tokens"
    placeholder = secret["stringData"]["TALLY_TOKENS"]
    text = (folder / "secret-tokens.yaml").read_text()
    assert "REPLACE the placeholder" in text and "kubectl create secret generic tally-tokens" in text
    # The placeholder is refused at start: an unedited Secret stops tally serve, it opens nothing.
    with pytest.raises(ValidationError, match="token entry 1 is not TOKEN:ROLE"):
        tally_settings({"TALLY_TOKENS": placeholder}, monkeypatch)
    for container in tally_containers(folder):
        (ref,) = [
            e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if e["name"] == "TALLY_TOKENS"
        ]
        assert ref == {"name": "tally-tokens", "key": "TALLY_TOKENS"}  # required: no optional: true
        # Nothing else sets it (a ConfigMap would show tokens to anyone who may read ConfigMaps).
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                (configmap,) = [
                    o
                    for objects in docs.values()
                    for o in objects
                    if o["kind"] == "ConfigMap" and o["metadata"]["name"] == source["configMapRef"]["name"]
                ]
                assert "TALLY_TOKENS" not in configmap["data"]


def compose_tally_services(path: Path) -> list[dict[str, Any]]:
    services = yaml.safe_load(path.read_text())["services"]
    found = [s for s in services.values() if "tally serve" in " ".join(s.get("command", ["tally", "serve"]))]
    return [s for s in found if s.get("image", "").startswith("tally")]


def env_example() -> dict[str, str]:
    """The variables .env.example sets or shows (commented out), with their values."""
    pairs = re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(), flags=re.MULTILINE)
    return dict(pairs)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_takes_tally_tokens_from_dot_env(path: Path) -> None:
    services = compose_tally_services(path)
    assert services, path
    for service in services:
        assert service["environment"]["TALLY_TOKENS"] == "${TALLY_TOKENS:-}"
    # Every variable the file reads is documented in .env.example.
    used = {m[1] for m in _INTERPOLATION.finditer(path.read_text())}
    assert "TALLY_TOKENS" in used
    assert used <= env_example().keys(), used - env_example().keys()


def test_dot_env_is_ignored_by_git_and_its_example_placeholder_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=REPO, check=False)
    assert ignored.returncode == 0, ".env must be in .gitignore: it holds the tokens"
    tracked = subprocess.run(
        ["git", "ls-files", ".env"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert tracked.stdout == ""
    example = env_example()
    assert "cp .env.example .env" in ENV_EXAMPLE.read_text()
    with pytest.raises(ValidationError, match="token entry 1 is not TOKEN:ROLE"):
        tally_settings({"TALLY_TOKENS": example["TALLY_TOKENS"]}, monkeypatch)
