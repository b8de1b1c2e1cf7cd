"""The registry's schema revisions (Alembic, in ``store/migrations``), applied when Tally starts.

``upgrade_registry`` brings a registry database to the newest revision this Tally knows:

* an empty database gets every revision;
* a database made before revisions existed (tables from ``create_all``, no ``alembic_version``)
  is checked against the first revision's tables, gets those it lacks, and then the later revisions;
* a database at a revision this Tally does not know (a newer Tally upgraded it) is refused.

One upgrade at a time: on PostgreSQL it runs in one transaction holding an advisory lock, so a
second coordinator starting at the same moment waits, then finds the database upgraded; on SQLite
in one ``BEGIN IMMEDIATE`` transaction. Either way a failed upgrade leaves the database as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from tally_server.store import pg_schema

MIGRATIONS = Path(__file__).with_name("migrations")
FIRST_REVISION = "0001"

# Another advisory lock key than the PostgreSQL store's ("tallystr"): "tallymig" as a bigint.
_MIGRATION_LOCK_KEY = int.from_bytes(b"tallymig", "big", signed=True)

# The PostgreSQL store's tables may share the registry's database; they are not the registry's.
_NOT_REGISTRY = frozenset(pg_schema.metadata.tables)

log = logging.getLogger(__name__)


class RegistrySchemaError(OSError):
    """The registry database holds a schema this Tally cannot use (too new, or not Tally's)."""


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic's filter of reflected names: every table of the database but the PostgreSQL store's."""
    return not (type_ == "table" and name in _NOT_REGISTRY)


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic configuration on the migrations shipped in this package (no ``alembic.ini``).

    With ``connection``, ``env.py`` migrates that connection (the only way it runs).
    """
    config = Config()
    # configparser interpolates %: a path holding one must double it.
    config.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision this Tally knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (``None``: no ``alembic_version``, empty or made before revisions)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade_registry(engine: Engine, display_url: str) -> None:
    """Bring the registry database to the newest revision, or refuse it (``RegistrySchemaError``)."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            # Released at commit or rollback: a second coordinator waits here, then finds head.
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        else:
            # pysqlite would run DDL outside any transaction; this makes the upgrade one, and keeps
            # another process's upgrade of the same file out until it commits.
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        _upgrade(conn, display_url)
        conn.commit()


def _upgrade(conn: Connection, display_url: str) -> None:
    config = alembic_config(conn)
    scripts = ScriptDirectory.from_config(config)
    head = scripts.get_current_head()
    known = {script.revision for script in scripts.walk_revisions()}
    current = MigrationContext.configure(conn).get_current_heads()
    unknown = [revision for revision in current if revision not in known]
    if unknown:
        raise RegistrySchemaError(
            f"the registry database {display_url} is at schema revision {unknown[0]}, which this "
            f"Tally does not know (its newest is {head}): a newer Tally has upgraded it; run that "
            "Tally or a newer one, or restore the backup taken before the upgrade"
        )
    if not current:
        _check_made_before_revisions(conn, scripts, display_url)
    if current and current != (head,):  # a new database is no news: only upgrades are logged
        log.info(
            "upgrading the registry database %s from schema revision %s to %s", display_url, current[0], head
        )
    command.upgrade(config, "head")


def _check_made_before_revisions(conn: Connection, scripts: ScriptDirectory, display_url: str) -> None:
    """A database without ``alembic_version``: its registry tables must be the first revision's."""
    first: sa.MetaData = scripts.get_revision(FIRST_REVISION).module.metadata
    present = set(sa.inspect(conn).get_table_names()) & set(first.tables)
    if not present:
        return  # empty (of registry tables): the first revision creates them all

    def ours(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
        return table in present

    context = MigrationContext.configure(conn, opts={"include_object": ours, "include_name": include_name})
    differences = compare_metadata(context, first)
    if differences:
        shown = "; ".join(_describe(diff) for diff in differences[:5])
        raise RegistrySchemaError(
            f"the registry database {display_url} has Tally's tables but not as any Tally made them "
            f"({shown}); point --registry-url at another database, or restore a backup"
        )
    log.info(
        "the registry database %s predates schema revisions: adopting it at revision %s",
        display_url,
        FIRST_REVISION,
    )


def _describe(diff: Any) -> str:
    """One autogenerate difference, short: ``('add_column', None, 'writers', Column(...))`` and the like."""
    if isinstance(diff, list):  # modifications of one column come as a list of tuples
        diff = diff[0]
    kind = diff[0]
    names = [str(getattr(part, "name", part)) for part in diff[1:] if part is not None]
    return f"{kind} {' '.join(names)[:120]}"
