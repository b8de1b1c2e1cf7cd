"""``./dev test`` creates the PostgreSQL database the tests connect to when it is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import sqlalchemy as sa

from tests.conftest import REPO


def setup(url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TALLY_TEST_POSTGRES_URL": url}
    command = [sys.executable, "-m", "tests.pg_setup"]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_a_missing_test_database_is_created_once(postgres_url: str) -> None:
    # postgres_url: PostgreSQL runs here (else this skips); the database to create is a new name.
    url = sa.make_url(postgres_url).set(database=f"tally_setup_{uuid.uuid4().hex[:12]}")
    text = url.render_as_string(hide_password=False)
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        first = setup(text)
        assert first.returncode == 0, first.stderr
        assert first.stderr.strip() == f"dev: created the PostgreSQL database the tests use: {text}"
        created = sa.create_engine(url)
        try:
            with created.connect() as conn:  # it exists now
                assert conn.execute(sa.text("SELECT current_database()")).scalar() == url.database
        finally:
            created.dispose()
        again = setup(text)
        assert (again.returncode, again.stderr) == (0, "")
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)'))
        admin.dispose()


def test_no_postgresql_is_a_note_not_a_failure() -> None:
    result = setup("postgresql+psycopg://postgres@127.0.0.1:1/test")
    assert result.returncode == 0
    assert result.stderr.startswith(
        "note: PostgreSQL tests will skip (they fail under CI=true): cannot use "
        "postgresql+psycopg://postgres@127.0.0.1:1/test: "
    )
    assert len(result.stderr.splitlines()) == 1
