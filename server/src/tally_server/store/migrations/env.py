"""Alembic's environment for the registry: migrate the connection ``registry_migrations`` hands over.

That connection is already inside the transaction that holds other coordinators out (an advisory
lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so every revision and the version row commit
together or not at all.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from tally_server.store.registry_migrations import include_name
from tally_server.store.registry_schema import metadata

if context.is_offline_mode():
    raise SystemExit("the registry's migrations run on a live database only (no --sql)")

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise SystemExit("run the registry's migrations through tally_server.store.registry_migrations")

context.configure(
    connection=connection,
    target_metadata=metadata,
    include_name=include_name,
    # SQLite alters a table by copying it: Alembic's batch mode does that for every ALTER.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
