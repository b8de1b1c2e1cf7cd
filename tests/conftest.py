"""Shared fixtures: real ``tally serve`` processes on free ports, fixture paths, PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tally_server.testing import RunningServer, running_server
from tests import pg_setup

REPO = Path(__file__).resolve().parents[1]
# Recordings of NeMo Curator 1.4.0 (see tests/fixtures/README.md); copies kept in the repository so
# that a plain clone passes.
FIXTURES = REPO / "tests" / "fixtures"
NEMO_TRACE = FIXTURES / "nemo_curator_1.4.0_trace_fanout_filter.jsonl"

# The database the tests create theirs from; ./dev test creates it when missing (tests/pg_setup.py).
POSTGRES_ADMIN_URL = pg_setup.test_url()


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on loopback right now (for a server that must listen where told)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def system_tool(name: str, package: str) -> str:
    """The path of a command from a Debian package; skip without it (fail under CI, which has it).

    ``./dev test`` installs these (``install_system_tools``) when it runs as root with apt-get.
    """
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian/Ubuntu: apt-get install -y {package})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run it")
        pytest.skip(message)
    return path


def load_trace() -> list[dict[str, Any]]:
    return [json.loads(line) for line in NEMO_TRACE.read_text().splitlines() if line.strip()]


def compiled_core_required() -> None:
    """Skip without the compiled counting core (fail under CI, where ./dev builds it)."""
    from tally_server.domain import idmap

    if idmap.COMPILED is None:
        message = "the compiled counting core (tally_server._ledgercore) is not built; ./dev builds it"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must test it")
        pytest.skip(message)


@pytest.fixture(scope="module", params=["compiled", "python"])
def each_ledger_core(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's tests once on each counting core (``pytestmark = usefixtures(...)``)."""
    from tally_server.domain import idmap

    if request.param == "compiled":
        compiled_core_required()
    before = idmap.current().name
    idmap.use(request.param)
    try:
        yield request.param
    finally:
        idmap.use(before)


@pytest.fixture(params=["arrays", "one by one"])
def each_lookup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with ``CompletedSet.contains_many`` asking its index over arrays whatever the
    number of ids, then one id at a time up to its usual threshold (a few ids)."""
    from tally_server.domain import completed

    monkeypatch.setattr(completed, "_ONE_BY_ONE", 0 if request.param == "arrays" else 1_000)
    return str(request.param)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    """A coordinator with settle_ms=0: NeMo Curator's exact behaviour, no timing involved."""
    with running_server(tmp_path / "data", settle_ms=0) as srv:
        yield srv


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    admin = sqlalchemy.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"tally_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    except sqlalchemy.exc.OperationalError as exc:
        admin.dispose()
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL}: {exc.orig}")
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
