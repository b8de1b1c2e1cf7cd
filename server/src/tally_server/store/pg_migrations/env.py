"""Alembic's environment for the PostgreSQL store: migrate the connection ``pg_revisions`` hands over."""

from tally_server.store.schema_revisions import run_environment

run_environment()
