"""Fixtures for the store tests: real LMDB files in tmp_path, real SQLite and PostgreSQL."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tally_server.store.lmdb_files import LmdbCompletionStore
from tally_server.store.registry import SqlRegistry, default_sqlite_url
from tests import nemo_format

POSTGRES_URL = os.environ.get("TALLY_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

NemoWrite = Callable[[Path, Iterable[str]], None]
ReadFile = Callable[[Path], set[str]]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def store(data_dir: Path) -> Iterator[LmdbCompletionStore]:
    with LmdbCompletionStore(data_dir) as completion_store:
        yield completion_store


@pytest.fixture(scope="session")
def nemo_write() -> NemoWrite:
    """Write ``sources`` into one file exactly as NeMo Curator 1.4.0's actor does."""
    return nemo_format.nemo_write


@pytest.fixture(scope="session")
def read_file() -> ReadFile:
    """The ids in one file, read without the store (the store must be closed or not hold it)."""

    return nemo_format.nemo_read_file


# --------------------------------------------------------------------- registry


@pytest.fixture(scope="session")
def registry_postgres_admin() -> Iterator[sa.Engine]:
    """An engine on the test PostgreSQL; skips the PostgreSQL cases if it is not reachable
    (fails instead under CI, where a silent skip would hide a missing database)."""
    engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 5})
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        engine.dispose()
        if os.environ.get("CI"):
            raise
        pytest.skip(
            f"PostgreSQL at {POSTGRES_URL} is not reachable ({exc.orig}); set TALLY_TEST_POSTGRES_URL "
            "or deselect with -m 'not postgres'"
        )
    yield engine
    engine.dispose()


@pytest.fixture
def registry_postgres_url(registry_postgres_admin: sa.Engine) -> Iterator[str]:
    """A URL on a fresh schema of its own (via search_path), dropped after the test.

    A schema rather than a database: as isolated for these tables and much cheaper to create.
    """
    schema = f"tally_test_{uuid.uuid4().hex[:16]}"
    with registry_postgres_admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = sa.make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with registry_postgres_admin.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def registry_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return default_sqlite_url(tmp_path / "data")
    url: str = request.getfixturevalue("registry_postgres_url")
    return url


@pytest.fixture
def registry(registry_url: str) -> Iterator[SqlRegistry]:
    with SqlRegistry(registry_url) as reg:
        yield reg
