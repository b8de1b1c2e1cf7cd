"""What the domain needs from storage.

Implemented in ``tally_server.store``; blocking calls, run by the service off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tally_server.domain.compact import U64, Hasher
from tally_server.domain.journal import Entry, JournaledWriter, Opened


@dataclass(frozen=True)
class UnreadableFile:
    """A completion file that could not be read, and why (its ids are never counted)."""

    path: str
    error: str


@dataclass
class LoadedCheckpoint:
    """The union of a checkpoint folder's ``*.mdb`` files."""

    completed: set[str]
    unreadable: list[UnreadableFile]
    # The files (writer ids) holding them, where the store tells (a PostgreSQL store's origins).
    origins: list[str] = field(default_factory=list)


@dataclass
class LoadedIndex:
    """The hashes of a checkpoint folder's ids, file by file (what a compact index is built from).

    ``origins[i]`` is the name of the file ``hashes[i]`` came from, without ``.mdb``.
    """

    origins: list[str]
    hashes: list[U64]
    files: list[str]
    unreadable: list[UnreadableFile]


@dataclass(frozen=True)
class PutCompleted:
    """Persist ``sources`` as completed in the writer's own file."""

    checkpoint: str
    writer_id: str
    sources: Sequence[str]


@dataclass(frozen=True)
class DeleteCompleted:
    """Un-complete ``sources`` in every writer file of the checkpoint that holds them."""

    checkpoint: str
    sources: Sequence[str]


CompletionOp = PutCompleted | DeleteCompleted


@dataclass(frozen=True)
class QuarantinedFile:
    """A writer's own completion file that could not be written was moved aside (never deleted).

    Its ids are not counted (as for any unreadable file); the commit went on into a fresh file at
    ``path``. ``moved_to`` is where the old file (or link) now is, under ``<data_dir>/.trash``.
    """

    checkpoint: str
    writer_id: str
    path: str
    moved_to: str
    error: str


class CompletionWriteError(Exception):
    """Completions could not be made durable because of the disk or the system.

    A full disk, an I/O error, a read-only filesystem: the commit did not become durable.
    Transient: applying the same ops again is safe and succeeds once the cause is gone.

    A damaged file of the writer's own never raises this: the store quarantines it instead.

    Attributes:
        path: the file (or folder) that could not be written.
        disk_full: the disk or quota holding the data directory is full (ENOSPC, EDQUOT); the
            message then says so and what to do.
        refuses: set when the commit was refused for the rows of some checkpoints only (those
            for which it is true: of a shard of the store this coordinator no longer holds); the
            same commit without their ops may go through. None: the commit failed as a whole.
    """

    refuses: Callable[[str], bool] | None = None

    def __init__(self, message: str, *, path: str, disk_full: bool) -> None:
        super().__init__(message)
        self.path = path
        self.disk_full = disk_full


@dataclass
class CommitReport:
    """What a successful ``commit`` had to do beyond writing: files it quarantined."""

    quarantined: list[QuarantinedFile] = field(default_factory=list)


class CompletionStore(Protocol):
    """NeMo-compatible completion files, one LMDB file per writer (DESIGN §3)."""

    #: Whether a lookup (``contains``) is a round trip to another process (a database). The
    #: service then holds a loaded checkpoint's ids in memory instead of a compact index whose hits
    #: are confirmed in the store: those confirmations run on the event loop.
    remote: bool

    def exists(self, checkpoint: str) -> bool:
        """Whether the checkpoint's folder exists (creates nothing)."""
        ...

    def load(self, checkpoint: str) -> LoadedCheckpoint:
        """Union of every ``*.mdb`` in the checkpoint folder; unreadable files are listed, not counted."""
        ...

    def load_index(self, checkpoint: str, hasher: Hasher) -> LoadedIndex:
        """``load``, as hashes of the ids per file (the same files readable, the same unreadable)."""
        ...

    def contains(self, checkpoint: str, origin: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether the file ``<origin>.mdb`` holds each key (UTF-8 id); unreadable or missing: no."""
        ...

    def keys_after(
        self, checkpoint: str, origins: Sequence[str], after: bytes, limit: int
    ) -> tuple[list[bytes], bool]:
        """Up to ``limit`` distinct keys of these files after ``after``, in key order.

        Also says whether those are the last.
        """
        ...

    def keys_matching(
        self, checkpoint: str, origins: Sequence[str], wanted: Callable[[bytes], bool]
    ) -> list[bytes]:
        """Every key of these files for which ``wanted`` is true."""
        ...

    def commit(self, ops: Sequence[CompletionOp]) -> CommitReport:
        """Apply ops in order, one synced transaction per file touched. Durable when it returns.

        A writer's own file that is damaged (or a link, or not a regular file) is quarantined and
        replaced by a fresh one; the report lists each such file.

        Raises:
            CompletionWriteError: the disk or the system refused; retry.
            ValueError: a name or id the store cannot hold (nothing was written).
        """
        ...

    def probe(self) -> None:
        """Write, sync and remove a small file where completions go; raises if that fails (disk full)."""
        ...

    def release_files(self, checkpoint: str, writer_id: str | None = None) -> None:
        """Close what the store keeps open to write the checkpoint's files (``writer_id``'s only).

        The next write of a file opens it again. Nothing to do for a database store.
        """
        ...

    def trash(self, checkpoint: str, stamp: str) -> tuple[str, int]:
        """Move the checkpoint's files to ``<data_dir>/.trash/<checkpoint>/<stamp>/``.

        Returns (the destination relative to the data dir, how many files moved). Never deletes.
        """
        ...

    def close(self) -> None:
        """Close every open file; the store refuses further calls."""


@dataclass
class CheckpointRecord:
    """A checkpoint's registry row: when it was created and last active, and its fingerprint."""

    name: str
    created_at: float
    last_activity_at: float
    fingerprint: dict[str, str] = field(default_factory=dict)


@dataclass
class WriterRecord:
    """A writer's registry row: who it is, its state, and its counters when last written."""

    handle: str
    checkpoint: str
    writer_id: str
    host: str
    pid: int
    labels: dict[str, str]
    fingerprint: dict[str, str]
    state: str
    opened_at: float
    last_seen_at: float
    closed_at: float | None = None
    pending_sources: int = 0
    applied: int = 0
    skipped: int = 0
    rewritten: int = 0
    anomalies: int = 0
    completed: int = 0


@dataclass
class EventRecord:
    """Something that happened to a checkpoint, as the registry keeps it (``id`` assigned by the database)."""

    checkpoint: str
    kind: str  # e.g. writer_opened, writer_closed, writer_expired, anomaly, unreadable_file
    message: str
    at: float
    writer_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    id: int | None = None


@dataclass(frozen=True)
class ProgressRecord:
    """A checkpoint's completed count at one moment (a point of the progress plot)."""

    checkpoint: str
    at: float
    completed_count: int


@dataclass(frozen=True)
class CursorRecord:
    """Where a writer got to inside a source: opaque bytes, with who saved them and when."""

    checkpoint: str
    source_id: str
    data: bytes
    saved_at: float
    writer_id: str


@dataclass(frozen=True)
class FailedAttemptRecord:
    """One failed attempt at a source."""

    reason: str
    at: float
    writer_id: str
    # The client's name for this attempt ("" when it gave none): a repeat is not counted again.
    attempt_id: str = ""


@dataclass(frozen=True)
class SourceFailuresRecord:
    """A source's failed attempts: how many, and the latest few."""

    checkpoint: str
    source_id: str
    attempts: int
    recent: list[FailedAttemptRecord]


@dataclass(frozen=True)
class ClaimRecord:
    """A claim on a source: its fencing token and the writer (handle and id) that holds it."""

    checkpoint: str
    source_id: str
    token: int
    holder: str  # the writer's handle; "" once released
    writer_id: str
    acquired_at: float


class Registry(Protocol):
    """Checkpoints, writers and events in a SQL database.

    A database that cannot be reached or written (down, disk full) raises
    :class:`tally_server.errors.Unavailable`; anything else that fails is a bug. On a PostgreSQL
    store holding the registry, a write about a checkpoint whose shard is no longer this
    coordinator's is refused as a whole, nothing written (``errors.RegistryFenced``, an
    ``Unavailable``).
    """

    def list_checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint, by name."""

    def write_batch(
        self,
        *,
        checkpoints: Sequence[CheckpointRecord] = (),
        writers: Sequence[WriterRecord] = (),
        events: Sequence[EventRecord] = (),
        samples: Sequence[ProgressRecord] = (),
    ) -> None:
        """Upsert checkpoints and writers, append events and samples: one transaction, all or nothing."""
        ...

    def latest_counts(self) -> dict[str, int]:
        """The completed count of each checkpoint's newest progress sample."""
        ...

    def list_writers(self, checkpoint: str) -> list[WriterRecord]:
        """The checkpoint's writers, oldest first."""

    def find_writer(self, handle: str) -> WriterRecord | None:
        """The writer whose handle this is, or None."""

    def mark_open_writers(
        self,
        state: str,
        at: float,
        keep: Collection[str] = (),
        owns: Callable[[str], bool] | None = None,
    ) -> list[WriterRecord]:
        """After a restart, set every writer still ``open`` and not in ``keep`` to ``state``.

        ``keep`` holds the handles the journal brought back; ``owns``: only writers of the
        checkpoints it accepts change (others belong to other live coordinators), None: all.
        Returns the writers changed.
        """
        ...

    def list_events(
        self, checkpoint: str, *, limit: int = 100, before_id: int | None = None
    ) -> list[EventRecord]:
        """Newest first; ``before_id`` pages backwards."""
        ...

    def list_samples(self, checkpoint: str, *, since: float = 0.0) -> list[ProgressRecord]:
        """The checkpoint's progress samples taken at or after ``since``, oldest first."""

    def delete_samples(self, checkpoint: str) -> None:
        """Drop the checkpoint's progress samples (a reset starts its plot over)."""

    def save_cursors(self, cursors: Sequence[CursorRecord]) -> None:
        """Write cursors (each replacing its source's), in one transaction: durable on return."""

    def get_cursor(self, checkpoint: str, source_id: str) -> CursorRecord | None:
        """The cursor saved for a source, if any."""

    def delete_cursors(self, checkpoint: str, source_ids: Sequence[str] | None = None) -> None:
        """Drop these sources' cursors (every cursor of the checkpoint with None)."""

    def record_failure(
        self, checkpoint: str, source_id: str, attempt: FailedAttemptRecord, keep: int
    ) -> tuple[int, bool]:
        """Count a failed attempt, keeping the latest ``keep`` reasons.

        Answers the attempts so far, and whether this one was a repeat (its ``attempt_id`` among
        the kept ones), which is not counted again.
        """

    def list_failures(
        self, checkpoint: str | None = None, source_ids: Sequence[str] | None = None
    ) -> list[SourceFailuresRecord]:
        """Sources with failed attempts, by checkpoint and source id (all checkpoints with None)."""

    def clear_failures(self, checkpoint: str, source_ids: Sequence[str] | None = None) -> None:
        """Forget these sources' failed attempts (every one of the checkpoint with None)."""

    def set_budget(self, checkpoint: str, max_attempts: int) -> None:
        """Record a checkpoint's failure budget (0: unlimited)."""

    def list_budgets(self) -> dict[str, int]:
        """Every checkpoint's failure budget that is set."""

    def failures_after(
        self, checkpoint: str, after: str, limit: int, min_attempts: int = 0
    ) -> list[SourceFailuresRecord]:
        """A page of ``list_failures``: up to ``limit`` sources after ``after`` in code point order.

        Only sources with ``min_attempts`` failed attempts or more.
        """

    def budget_of(self, checkpoint: str) -> int:
        """A checkpoint's failure budget (0: none set, unlimited)."""

    def add_declared(self, checkpoint: str, source_ids: Sequence[str], count: int) -> None:
        """Add declared sources (those declared already are left as they are) and raise the count."""

    def list_declared(self) -> tuple[dict[str, set[str]], dict[str, int]]:
        """Every checkpoint's declared sources and declared count."""

    def declared_after(self, checkpoint: str, after: str, limit: int) -> list[str]:
        """Up to ``limit`` declared sources of a checkpoint after ``after``, in code point order."""

    def take_claims(
        self, checkpoint: str, source_ids: Sequence[str], holder: str, writer_id: str, at: float
    ) -> dict[str, int]:
        """Claim sources for a writer, durably: each one's new token, above any it had before."""

    def release_claims(self, checkpoint: str, holder: str, source_ids: Sequence[str] | None = None) -> None:
        """End a writer's claims (on these sources, or all of them with None); tokens stay."""

    def live_claims(self) -> list[ClaimRecord]:
        """Every claim not released, by checkpoint and source id."""

    def close(self) -> None:
        """Release the database connections."""


@dataclass(frozen=True)
class OpenJournal:
    """Start a writer's journal: who it is."""

    opened: Opened


@dataclass(frozen=True)
class JournalEntry:
    """Append ``entry`` as the writer's ``index``-th (a snapshot also drops the entries before it)."""

    handle: str
    index: int
    entry: Entry
    # The writer's checkpoint: a store of several shards refuses the entry unless the commit is
    # fenced by that checkpoint's shard (``store.shards.ShardFence``). Empty: not said, not checked.
    checkpoint: str = ""


@dataclass(frozen=True)
class ForgetWriter:
    """The writer closed or expired: drop its journal."""

    handle: str
    checkpoint: str = ""  # as ``JournalEntry.checkpoint``


JournalOp = OpenJournal | JournalEntry | ForgetWriter


def checkpoint_of(op: JournalOp | CompletionOp) -> str:
    """The checkpoint whose rows ``op`` writes ("" for a journal op that does not say)."""
    return op.opened.checkpoint if isinstance(op, OpenJournal) else op.checkpoint


def checkpoints_of(ops: Iterable[JournalOp | CompletionOp]) -> set[str]:
    """The checkpoints whose rows ``ops`` write (those that say theirs)."""
    return {name for name in map(checkpoint_of, ops) if name}


#: Where the journal and the completions live in one database (the PostgreSQL store): commits a
#: group's journal ops, then its completion ops, in one transaction, durable on return; a failure
#: writes neither. Raises what ``Journal.commit`` and ``CompletionStore.commit`` raise.
JointCommit = Callable[[Sequence[JournalOp], Sequence[CompletionOp]], CommitReport]


class Journal(Protocol):
    """Writers' journals (DESIGN §2.1): what a restart needs to bring every live writer back.

    A journal that cannot be written raises :class:`CompletionWriteError` (transient).
    """

    def commit(self, ops: Sequence[JournalOp]) -> None:
        """Apply ``ops`` in order, durably, all or nothing."""
        ...

    def load(self, owns: Callable[[str], bool] | None = None) -> list[JournaledWriter]:
        """Every journaled writer with its entries in order.

        ``owns``: only the writers of the checkpoints it accepts (by name); None: every writer.
        """
        ...

    def size_bytes(self) -> int:
        """Bytes the journal takes on disk."""
        ...

    def entries(self) -> int:
        """How many entries the journal holds."""
        ...

    def memory_bytes(self) -> int:
        """Memory the journal's live state takes in this process (0 where it is not held in memory)."""
        ...

    def close(self) -> None:
        """Close the journal's file."""
