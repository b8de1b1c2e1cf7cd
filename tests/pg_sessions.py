"""Ending PostgreSQL sessions of a test database, as a restart of PostgreSQL (or an administrator) does."""

from __future__ import annotations

import sqlalchemy as sa

from tests.conftest import POSTGRES_ADMIN_URL


def end_sessions(url: str, pids: list[int] | None = None) -> int:
    """End sessions of ``url``'s database (all but the asking one's, or those of ``pids``): a restart."""
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = :name "
                        "AND pid <> pg_backend_pid() AND (CAST(:pids AS int[]) IS NULL OR pid = ANY(:pids))"
                    ),
                    {"name": sa.make_url(url).database, "pids": pids},
                ).scalar_one()
            )
    finally:
        admin.dispose()


def alter_database(url: str, clause: str) -> None:
    """``ALTER DATABASE <url's database> <clause>``, as the administrator (new sessions see it)."""
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{sa.make_url(url).database}" {clause}'))
    finally:
        admin.dispose()


def allow_connections(url: str, allow: bool) -> None:
    """``ALTER DATABASE ... ALLOW_CONNECTIONS``: the test's own database "down" (false) or back."""
    alter_database(url, f"ALLOW_CONNECTIONS {str(allow).lower()}")
