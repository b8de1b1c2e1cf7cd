"""The image installs exact versions: deploy/constraints.txt pins every dependency (issue #13, item 5).

``deploy/Dockerfile`` builds its wheels with ``pip wheel -c deploy/constraints.txt``; for that to make
two builds of one commit equal, every runtime requirement of ``client/`` and ``server/`` (extras
included, and what they pull in) must be pinned there with ``==``, within the range its pyproject
asks for. The image is not built here (no registry to pull its base from); the files are checked.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.test_deploy_files import dockerfile_stages

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "deploy" / "constraints.txt"
LOCAL = {"tally-client", "tally-server"}


def project(dist: str) -> dict[str, Any]:
    loaded = tomllib.loads((REPO / dist / "pyproject.toml").read_text())["project"]
    assert isinstance(loaded, dict)
    return loaded


def pins() -> dict[str, Version]:
    """Name -> pinned version; every line must be NAME==VERSION (comments aside)."""
    pinned: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one specifier ...
        assert spec.operator == "==" and "*" not in spec.version, line  # ... and it is exact
        assert not req.marker and not req.url and not req.extras, line
        name = canonicalize_name(req.name)
        assert name not in pinned, f"{req.name} pinned twice"
        pinned[name] = Version(spec.version)
    return pinned


def runtime_requirements() -> list[Requirement]:
    """What the image installs: both distributions' dependencies and the SDK's extras."""
    client, server = project("client"), project("server")
    lines = [*client["dependencies"], *server["dependencies"]]
    for extra in client.get("optional-dependencies", {}).values():
        lines += extra
    return [Requirement(line) for line in lines]


def test_every_runtime_dependency_is_pinned_within_its_pyproject_range() -> None:
    pinned = pins()
    requirements = [r for r in runtime_requirements() if canonicalize_name(r.name) not in LOCAL]
    assert len(requirements) >= 15  # the server alone asks for more than that
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned in deploy/constraints.txt: regenerate it"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"deploy/constraints.txt pins {req.name}=={pinned[name]}, outside {req} in the pyproject: "
            "regenerate it (its header says how)"
        )
        for extra in req.extras:  # psycopg[binary] -> psycopg-binary, pinned to the same release
            assert canonicalize_name(f"{req.name}-{extra}") in pinned, f"{req.name}[{extra}]"


def test_the_local_packages_are_not_pinned() -> None:
    # They are built from this checkout; a pin would go stale at every version bump.
    assert not LOCAL & pins().keys()


def test_the_image_builds_its_wheels_with_the_constraints() -> None:
    builder = dockerfile_stages()[0]
    copied = {args.split()[0]: args.split()[1] for args in builder.all("COPY")}
    inside = copied["deploy/constraints.txt"]
    (wheel,) = [run for run in builder.all("RUN") if "pip wheel" in run]
    assert f"-c {inside}" in wheel or f"--constraint {inside}" in wheel, wheel
    # The runtime installs those wheels only: nothing resolved afresh past the constraints.
    (install,) = [run for run in dockerfile_stages()[-1].all("RUN") if "pip install" in run]
    assert "--no-index" in install
