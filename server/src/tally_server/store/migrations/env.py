"""Alembic's environment for the registry: migrate the connection ``registry_migrations`` hands over."""

from tally_server.store.schema_revisions import run_environment

run_environment()
