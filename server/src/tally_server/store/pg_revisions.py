"""The PostgreSQL store's schema revisions (Alembic, in ``store/pg_migrations``), applied when it opens.

Every part that opens the store (the store lock, the completions, the journal, the replica board,
the status board) calls :func:`upgrade_store` first; it runs once per database and process. See
``schema_revisions`` for what an upgrade does: a database made before the store had revisions
(tables from ``create_all``) is checked and adopted, one a newer Tally upgraded is refused.
"""

from __future__ import annotations

import threading
from pathlib import Path

import sqlalchemy as sa

from tally_server.store import pg_schema
from tally_server.store.schema_revisions import SchemaRevisions

MIGRATIONS = Path(__file__).with_name("pg_migrations")
FIRST_REVISION = "s0001"


class StoreSchemaError(OSError):
    """The store's database holds a schema this Tally cannot use (too new, or not Tally's)."""


REVISIONS = SchemaRevisions(
    what="PostgreSQL store",
    directory=MIGRATIONS,
    version_table=pg_schema.VERSION_TABLE,
    # Not the registry's upgrade lock ("tallymig") nor the store's own lock ("tallystr").
    lock_key=int.from_bytes(b"tallysmg", "big", signed=True),
    first=FIRST_REVISION,
    metadata=pg_schema.metadata,
    owns=lambda name: name in pg_schema.metadata.tables,
    error=StoreSchemaError,
    otherwise="point --store at another database (or another schema of it), or restore a backup",
    tolerated_indexes=frozenset(pg_schema.LEGACY_INDEXES),
)

_upgraded: set[str] = set()
_upgrading = threading.Lock()


def upgrade_store(engine: sa.Engine, display_url: str) -> None:
    """Bring the store's tables to the newest revision (once per database and process).

    Raises:
        StoreSchemaError: a newer Tally upgraded the database, or its tables are not as Tally made them.
        sqlalchemy.exc.DBAPIError: the database could not be reached (the caller says so).
    """
    key = engine.url.render_as_string(hide_password=False)
    with _upgrading:
        if key in _upgraded:
            return
        REVISIONS.upgrade(engine, display_url)
        _upgraded.add(key)
