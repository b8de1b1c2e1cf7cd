"""Create the PostgreSQL database the tests connect to, if the server runs but lacks it.

The ``postgres_url`` fixture (``tests/conftest.py``) connects to ``$TALLY_TEST_POSTGRES_URL``
(default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``) and creates one database per test
from there. A fresh PostgreSQL has no database ``test``, and the tests would skip as if there were
no PostgreSQL at all; ``./dev test`` runs this first (``python -m tests.pg_setup``).
"""

from __future__ import annotations

import os
import sys

import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def test_url() -> str:
    """The URL the tests connect to."""
    return os.environ.get("TALLY_TEST_POSTGRES_URL", DEFAULT_URL)


def ensure_database(url: str) -> bool:
    """Create ``url``'s database when the server answers that it does not exist.

    Returns:
        True if it was created; False if it was there already.

    Raises:
        sqlalchemy.exc.OperationalError: The server cannot be reached, or refused for another reason.
    """
    target = sa.make_url(url)
    engine = sa.create_engine(target, connect_args={"connect_timeout": 5})
    try:
        with engine.connect():
            return False
    except sa.exc.OperationalError as exc:
        if f'database "{target.database}" does not exist' not in str(exc.orig):
            raise
    finally:
        engine.dispose()
    maintenance = sa.create_engine(
        target.set(database="postgres"), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )
    try:
        with maintenance.connect() as conn:
            name = conn.dialect.identifier_preparer.quote(str(target.database))
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    finally:
        maintenance.dispose()
    return True


def main() -> int:
    url = test_url()
    shown = sa.make_url(url).render_as_string(hide_password=True)
    try:
        created = ensure_database(url)
    except sa.exc.OperationalError as exc:
        reason = " ".join(str(exc.orig).split())
        print(
            f"note: PostgreSQL tests will skip (they fail under CI=true): cannot use {shown}: {reason}",
            file=sys.stderr,
        )
        return 0
    if created:
        print(f"dev: created the PostgreSQL database the tests use: {shown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
