"""Ending PostgreSQL sessions of a test database, as a restart of PostgreSQL (or an administrator) does."""

from __future__ import annotations

import sqlalchemy as sa

from tests.conftest import POSTGRES_ADMIN_URL
from tests.polling import wait_until


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


def end_sessions_lock_holders_last(url: str) -> int:
    """End every session of ``url``'s database, those holding an advisory lock (a store's owner) last.

    ``pg_terminate_backend`` only signals a backend: one ended in the same sweep as the owner's can
    still run a statement after the owner's lock was released, and take it. Ending the others first,
    and the lock holders once the others are gone, leaves nobody to take the lock. Returns how many
    sessions were ended.
    """
    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = sa.make_url(url).database
    sessions = sa.text("SELECT pid FROM pg_stat_activity WHERE datname = :name AND pid <> pg_backend_pid()")
    holders = sa.text(
        "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
        "database = (SELECT oid FROM pg_database WHERE datname = :name)"
    )
    try:
        with admin.connect() as conn:
            last = set(conn.execute(holders, {"name": name}).scalars())
            first = [pid for pid in conn.execute(sessions, {"name": name}).scalars() if pid not in last]
            ended = end_sessions(url, first) if first else 0
            wait_until(
                lambda: not set(first) & set(conn.execute(sessions, {"name": name}).scalars()),
                timeout=30,
                what="the sessions not holding the store's lock to end",
            )
            return ended + (end_sessions(url, sorted(last)) if last else 0)
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
