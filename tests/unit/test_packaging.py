"""Installing the server resolves the SDK to this checkout's ``tally-client``, and to nothing else.

PyPI's ``tally`` is an unrelated project; a bare ``tally`` requirement once made
``pip install ./server`` install it. Here pip resolves ``./server`` for real, offline: the index is
a folder holding the client wheel built from ``./client``, a decoy ``tally`` wheel standing for the
PyPI project, and metadata-only wheels for the third-party requirements (what pip picks for those
is not under test; that it can pick something lets it resolve the rest).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def pyproject(dist: str) -> dict[str, object]:
    project = tomllib.loads((REPO / dist / "pyproject.toml").read_text())["project"]
    assert isinstance(project, dict)
    return project


CLIENT, SERVER = pyproject("client"), pyproject("server")


def stub_wheel(
    folder: Path, name: str, version: str, extras: frozenset[str] | set[str] = frozenset()
) -> Path:
    """A wheel with metadata only: enough for pip's resolver."""
    dist = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Provides-Extra: {e}\n" for e in sorted(extras)),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def third_party_requirements() -> dict[str, set[str]]:
    """Every requirement of both distributions but the SDK itself: name -> extras asked for."""
    lines = [*SERVER["dependencies"], *CLIENT["dependencies"]]  # type: ignore[misc]
    for extra in CLIENT.get("optional-dependencies", {}).values():  # type: ignore[attr-defined]
        lines += extra
    wanted: dict[str, set[str]] = {}
    for line in lines:
        req = Requirement(line)
        if req.name != CLIENT["name"]:
            wanted.setdefault(req.name, set()).update(req.extras)
    return wanted


def pip_offline(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # No pip configuration of this machine (its find-links, constraints, extra indexes) leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-index", "--disable-pip-version-check"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A find-links folder: the real client wheel, a decoy ``tally``, metadata for the rest."""
    folder = tmp_path_factory.mktemp("index")
    built = pip_offline(
        "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), str(REPO / "client"), cwd=folder
    )
    assert built.returncode == 0, built.stderr
    stub_wheel(folder, "tally", "0.6.2")  # stands for PyPI's unrelated project
    for name, extras in third_party_requirements().items():
        stub_wheel(folder, name, importlib.metadata.version(name), extras)
    return folder


# What a build leaves in the checkout: never copied into a test's own copy of it.
COPY_IGNORES = shutil.ignore_patterns("*.egg-info", "__pycache__", "build", "*.so")


def resolve_server(index: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    server = tmp_path / "server"
    shutil.copytree(REPO / "server", server, ignore=COPY_IGNORES)
    return pip_offline(
        "install",
        "--dry-run",
        "--ignore-installed",
        "--no-build-isolation",
        "--find-links",
        str(index),
        "--report",
        str(tmp_path / "report.json"),
        str(server),
        cwd=tmp_path,
    )


def test_the_server_pins_the_sdk_by_its_distribution_name_and_exact_version() -> None:
    assert CLIENT["name"] == "tally-client"
    pins = [
        Requirement(r) for r in SERVER["dependencies"] if Requirement(r).name in ("tally", "tally-client")
    ]  # type: ignore[attr-defined]
    assert [(p.name, str(p.specifier)) for p in pins] == [("tally-client", f"=={CLIENT['version']}")]


def test_installing_the_server_picks_this_checkouts_client_and_never_pypis_tally(
    index: Path, tmp_path: Path
) -> None:
    result = resolve_server(index, tmp_path)
    assert result.returncode == 0, result.stderr
    chosen = {
        item["metadata"]["name"]: item
        for item in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    assert "tally" not in chosen
    client = chosen["tally-client"]
    assert client["metadata"]["version"] == CLIENT["version"]
    assert client["download_info"]["url"].endswith(f"tally_client-{CLIENT['version']}-py3-none-any.whl")
    # The wheel built from ./client, not a stand-in: it carries the SDK's modules.
    assert (index / Path(client["download_info"]["url"]).name).stat().st_size > 20_000


def test_installing_the_server_fails_clearly_without_the_exact_client_version(
    index: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-index"
    shutil.copytree(index, other)
    for wheel in other.glob("tally_client-*.whl"):
        wheel.unlink()
    stub_wheel(other, "tally-client", "0.0.9")  # an SDK of another version is no substitute
    result = resolve_server(other, tmp_path)
    assert result.returncode != 0
    assert f"tally-client=={CLIENT['version']}" in result.stderr
    assert "No matching distribution found" in result.stderr


def test_the_client_wheel_ships_py_typed(index: Path) -> None:
    # Without the marker mypy ignores the SDK's annotations in users' code (and says so).
    (wheel,) = index.glob("tally_client-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "tally/py.typed" in names, names
    assert "tally/__init__.py" in names


@pytest.fixture(scope="module")
def server_wheel(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The names in a wheel built from a copy of ./server, offline (the checkout is left as it is)."""
    tmp = tmp_path_factory.mktemp("server-wheel")
    shutil.copytree(REPO / "server", tmp / "server", ignore=COPY_IGNORES)
    built = pip_offline(
        "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(tmp / "server"), cwd=tmp
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp.glob("tally_server-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_the_server_wheel_ships_the_registrys_migrations(server_wheel: set[str]) -> None:
    names = server_wheel
    shipped = REPO / "server/src"
    expected = {
        str(path.relative_to(shipped))
        for folder in ("migrations", "pg_migrations")
        for path in (shipped / "tally_server/store" / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert {
        "tally_server/store/migrations/env.py",
        "tally_server/store/migrations/script.py.mako",
        "tally_server/store/pg_migrations/script.py.mako",
    } <= expected
    assert any(name.startswith("tally_server/store/migrations/versions/v0001") for name in expected)
    assert expected <= names


def test_the_server_wheel_ships_the_dashboard_and_the_compiled_cores_types(server_wheel: set[str]) -> None:
    dashboard = REPO / "server/src/tally_server/http_api/dashboard"
    files = {f"tally_server/http_api/dashboard/{p.relative_to(dashboard)}" for p in dashboard.rglob("*.*")}
    assert "tally_server/http_api/dashboard/index.html" in files
    assert files <= server_wheel
    assert "tally_server/_ledgercore.pyi" in server_wheel


def test_the_server_wheel_carries_the_compiled_counting_core(server_wheel: set[str]) -> None:
    # setup.py's extension is optional: a wheel built without a C compiler lacks it (and the server
    # then runs the rules in Python). Here, as on every machine ./dev runs on, gcc is at hand.
    if shutil.which("gcc") is None and shutil.which("cc") is None and not os.environ.get("CI"):
        pytest.skip("no C compiler here: the wheel is built without the compiled core")
    assert any(re.fullmatch(r"tally_server/_ledgercore\..*\.so", name) for name in server_wheel), sorted(
        n for n in server_wheel if "_ledgercore" in n
    )
