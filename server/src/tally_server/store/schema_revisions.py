"""Schema revisions (Alembic) of a set of Tally's tables, applied when Tally starts.

Two sets have their own revisions: the registry's tables (``registry_migrations``, in
``store/migrations``) and the PostgreSQL store's (``store_migrations``, in ``store/store_migrations``).
Both may live in one database, so each keeps its revision in a version table of its own and sees
only its own tables. :meth:`SchemaRevisions.upgrade` brings a database to the newest revision this
Tally knows:

* an empty database gets every revision;
* a database made before revisions existed (tables from ``create_all``, no version table) is checked
  against the first revision's tables, gets those it lacks, and then the later revisions;
* a database at a revision this Tally does not know (a newer Tally upgraded it) is refused.

One upgrade at a time: on PostgreSQL it runs in one transaction holding an advisory lock, so a
second coordinator starting at the same moment waits, then finds the database upgraded; on SQLite
in one ``BEGIN IMMEDIATE`` transaction. Either way a failed upgrade leaves the database as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command, context
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchemaRevisions:
    """The revisions of one set of tables.

    Args:
        what: what the tables are, for messages ("registry", "PostgreSQL store").
        directory: the Alembic script directory (``env.py`` calls :func:`run_environment`).
        version_table: where the database's revision is kept.
        lock_key: the PostgreSQL advisory lock an upgrade holds (a bigint of its own).
        first: the first revision (what ``create_all`` made before revisions existed).
        metadata: the tables as this Tally's code uses them (the drift check compares the revisions with it).
        owns: whether a table of the database is one of this set's.
        error: raised for a database this Tally cannot use (an ``OSError``: one line at start).
        otherwise: what to do about a database with these tables made otherwise (ends the message).
        tolerated_indexes: indexes a database made before revisions may still have (dropped at start).
    """

    what: str
    directory: Path
    version_table: str
    lock_key: int
    first: str
    metadata: sa.MetaData
    owns: Callable[[str], bool]
    error: type[OSError]
    otherwise: str
    tolerated_indexes: frozenset[str] = field(default_factory=frozenset)

    def include_name(self, name: str | None, type_: str, parent_names: Any) -> bool:
        """Alembic's filter of reflected names: this set's tables only."""
        return not (type_ == "table" and (name is None or not self.owns(name)))

    def config(self, connection: Connection | None = None) -> Config:
        """An Alembic configuration on these revisions (no ``alembic.ini``).

        With ``connection``, ``env.py`` migrates that connection (the only way it runs).
        """
        config = Config()
        # configparser interpolates %: a path holding one must double it.
        config.set_main_option("script_location", str(self.directory).replace("%", "%%"))
        config.attributes["revisions"] = self
        if connection is not None:
            config.attributes["connection"] = connection
        return config

    def head(self) -> str:
        """The newest revision this Tally knows."""
        head = ScriptDirectory.from_config(self.config()).get_current_head()
        assert head is not None
        return head

    def current(self, engine: Engine) -> str | None:
        """The revision the database is at (``None``: no version table, empty or made before revisions)."""
        with engine.connect() as conn:
            return self._context(conn).get_current_revision()

    def _context(self, conn: Connection, **opts: Any) -> MigrationContext:
        return MigrationContext.configure(conn, opts={"version_table": self.version_table, **opts})

    def upgrade(self, engine: Engine, display_url: str) -> None:
        """Bring the database to the newest revision, or refuse it (``self.error``)."""
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                # Released at commit or rollback: a second coordinator waits here, then finds head.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": self.lock_key})
            else:
                # pysqlite would run DDL outside any transaction; this makes the upgrade one, and keeps
                # another process's upgrade of the same file out until it commits.
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            self._upgrade(conn, display_url)
            conn.commit()

    def _upgrade(self, conn: Connection, display_url: str) -> None:
        config = self.config(conn)
        scripts = ScriptDirectory.from_config(config)
        head = scripts.get_current_head()
        known = {script.revision for script in scripts.walk_revisions()}
        current = self._context(conn).get_current_heads()
        unknown = [revision for revision in current if revision not in known]
        if unknown:
            raise self.error(
                f"the {self.what} database {display_url} is at schema revision {unknown[0]}, which this "
                f"Tally does not know (its newest is {head}): a newer Tally has upgraded it; run that "
                "Tally or a newer one, or restore the backup taken before the upgrade"
            )
        start = current[0] if current else None
        if not current and self._check_made_before_revisions(conn, scripts, display_url):
            start = self.first
        if start is not None and start != head:  # a new database is no news: only upgrades are logged
            what = f"the {self.what} database {display_url}"
            log.info("upgrading %s from schema revision %s to %s", what, start, head)
        command.upgrade(config, "head")

    def _check_made_before_revisions(
        self, conn: Connection, scripts: ScriptDirectory, display_url: str
    ) -> bool:
        """A database without a version table: its tables of this set must be the first revision's.

        Returns whether it had any (adopted at the first revision), False for an empty one.
        """
        first: sa.MetaData = scripts.get_revision(self.first).module.metadata
        present = set(sa.inspect(conn).get_table_names()) & set(first.tables)
        if not present:
            return False  # empty (of these tables): the first revision creates them all

        def ours(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
            if type_ == "index" and name in self.tolerated_indexes:
                return False
            table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
            return table in present

        context_ = self._context(conn, include_object=ours, include_name=self.include_name)
        differences = compare_metadata(context_, first)
        if differences:
            shown = "; ".join(_describe(diff) for diff in differences[:5])
            raise self.error(
                f"the {self.what} database {display_url} has Tally's tables but not as any Tally made "
                f"them ({shown}); {self.otherwise}"
            )
        log.info(
            "the %s database %s predates schema revisions: adopting it at revision %s",
            self.what,
            display_url,
            self.first,
        )
        return True


def run_environment() -> None:
    """An ``env.py``'s body: migrate the connection :meth:`SchemaRevisions.upgrade` hands over.

    That connection is already inside the transaction that holds other coordinators out (an advisory
    lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so every revision and the version row commit
    together or not at all.
    """
    if context.is_offline_mode():
        raise SystemExit("Tally's migrations run on a live database only (no --sql)")
    revisions = context.config.attributes.get("revisions")
    connection = context.config.attributes.get("connection")
    if not isinstance(revisions, SchemaRevisions) or not isinstance(connection, Connection):
        raise SystemExit("run Tally's migrations through tally_server.store.schema_revisions")
    context.configure(
        connection=connection,
        target_metadata=revisions.metadata,
        include_name=revisions.include_name,
        version_table=revisions.version_table,
        # SQLite alters a table by copying it: Alembic's batch mode does that for every ALTER.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _describe(diff: Any) -> str:
    """One autogenerate difference, short: ``('add_column', None, 'writers', Column(...))`` and the like."""
    if isinstance(diff, list):  # modifications of one column come as a list of tuples
        diff = diff[0]
    kind = diff[0]
    names = [str(getattr(part, "name", part)) for part in diff[1:] if part is not None]
    return f"{kind} {' '.join(names)[:120]}"
