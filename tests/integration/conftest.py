"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tally.v1 import coordinator_pb2_grpc as pb_grpc
from tally_server.store.postgres import StoreLock
from tally_server.testing import RunningServer
from tests.integration import raw

STORES = ["lmdb", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str | None:
    """Each test twice: None (default LMDB files, SQLite registry), then a fresh PostgreSQL database."""
    return request.getfixturevalue("postgres_url") if request.param == "postgresql" else None


@pytest.fixture
def stub(server: RunningServer) -> Iterator[pb_grpc.CoordinatorStub]:
    """A raw gRPC stub to the test's ``server``."""
    with raw.stub(server) as coordinator:
        yield coordinator


@pytest.fixture
def locks() -> Iterator[list[StoreLock]]:
    """Store locks a test takes, released at its end (whatever it asserted)."""
    taken: list[StoreLock] = []
    yield taken
    for lock in taken:
        lock.release()
