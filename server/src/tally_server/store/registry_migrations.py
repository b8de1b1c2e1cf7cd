"""The registry's schema revisions (Alembic, in ``store/migrations``), applied when Tally starts.

See ``schema_revisions`` for what an upgrade does; ``upgrade_registry`` runs it on the registry's
database, which may also hold the PostgreSQL store's tables (those have revisions of their own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic.config import Config
from sqlalchemy.engine import Connection, Engine

from tally_server.store import pg_schema, registry_schema
from tally_server.store.schema_revisions import SchemaRevisions

MIGRATIONS = Path(__file__).with_name("migrations")
FIRST_REVISION = "0001"

# The PostgreSQL store's tables may share the registry's database; they are not the registry's.
_NOT_REGISTRY = frozenset(pg_schema.metadata.tables) | {pg_schema.VERSION_TABLE}


class RegistrySchemaError(OSError):
    """The registry database holds a schema this Tally cannot use (too new, or not Tally's)."""


REVISIONS = SchemaRevisions(
    what="registry",
    directory=MIGRATIONS,
    version_table="alembic_version",
    # Another advisory lock key than the PostgreSQL store's ("tallystr"): "tallymig" as a bigint.
    lock_key=int.from_bytes(b"tallymig", "big", signed=True),
    first=FIRST_REVISION,
    metadata=registry_schema.metadata,
    owns=lambda name: name not in _NOT_REGISTRY,
    error=RegistrySchemaError,
    otherwise="point --registry-url at another database, or restore a backup",
)


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic's filter of reflected names: every table of the database but the PostgreSQL store's."""
    return REVISIONS.include_name(name, type_, parent_names)


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic configuration on the registry's revisions (no ``alembic.ini``)."""
    return REVISIONS.config(connection)


def head_revision() -> str:
    """The newest revision this Tally knows."""
    return REVISIONS.head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (``None``: no ``alembic_version``, empty or made before revisions)."""
    return REVISIONS.current(engine)


def upgrade_registry(engine: Engine, display_url: str) -> None:
    """Bring the registry database to the newest revision, or refuse it (``RegistrySchemaError``)."""
    REVISIONS.upgrade(engine, display_url)
