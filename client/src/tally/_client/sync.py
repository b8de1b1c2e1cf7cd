"""The blocking client: plans built by :class:`BaseClient`, sent through ``_retry.send``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Self, TypeVar

from tally import _calls as calls
from tally._client.base import BaseClient, resolve_config
from tally._config import ClientConfig
from tally._retry import Deadline, send
from tally._trace import open_recorder
from tally._transport.base import Transport, make_transport
from tally._types import (
    CheckpointStatus,
    EventPage,
    ImportResult,
    OnMismatch,
    ProgressSample,
    Replicas,
    ResetResult,
    SourceFailures,
    WriterStatus,
)
from tally._writer import Writer
from tally.errors import TallyError, Unavailable

logger = logging.getLogger("tally._client")

T = TypeVar("T")


class Client(BaseClient):
    """Blocking client of a Tally coordinator.

    Example::

        client = tally.Client("grpc://coordinator:50051", token=token)
        with client.writer("curation/run-42", fingerprint={"pipeline": h1}) as w:
            todo = [s for s, done in zip(sources, w.are_completed(sources)) if not done]
            w.apply_deltas([(task_id, source_id, +1)])
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        timeout: float | None = None,
        ca_cert: str | os.PathLike[str] | None = None,
        client_cert: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
    ):
        """Create a client; no connection is made until the first call.

        Args:
            address: ``host:port`` or ``grpc://host:port`` (gRPC), ``grpcs://`` (TLS),
                ``http://host:port`` or ``https://`` (HTTP/JSON). Defaults to ``$TALLY_ADDRESS``,
                else ``127.0.0.1:50051``. A comma-separated list names several coordinator
                replicas, all on one wire and all TLS or none (``h1:50051,h2:50051``): the client
                starts on a random one, which spreads a fleet's reads over them, and moves to the
                next whenever one is unavailable, retrying there within ``timeout``.
            token: Bearer token; defaults to ``$TALLY_TOKEN``.
            timeout: Seconds each call may take, retries included; defaults to ``$TALLY_TIMEOUT``,
                else 30. A refused connection before the coordinator ever answered this client is
                not retried: :class:`Unavailable` at once says that nothing listens there.
            ca_cert: PEM file of the CA that signed the coordinator's certificate (``grpcs://``,
                ``https://``); defaults to ``$TALLY_CA_CERT``, else the system's root certificates.
            client_cert: PEM certificate for a coordinator that requires client certificates
                (mutual TLS); defaults to ``$TALLY_CLIENT_CERT``.
            client_key: PEM private key of ``client_cert``; defaults to ``$TALLY_CLIENT_KEY``.

        Raises:
            ValueError: The address has an unsupported scheme (or a list of them mixes wires, TLS
                and plain text, or has an empty element), TLS files are given for a plain-text
                address, or a TLS file cannot be read.
        """
        tls_files = {"ca_cert": ca_cert, "client_cert": client_cert, "client_key": client_key}
        config = resolve_config(address, token, timeout, tls_files)
        self._init(config, make_transport(config))

    @classmethod
    def from_config(cls, config: ClientConfig) -> Self:
        """Create a client from a :class:`ClientConfig` (e.g. ``ClientConfig.from_env()``)."""
        client = cls.__new__(cls)
        client._init(config, make_transport(config))
        return client

    def _init(self, config: ClientConfig, transport: Transport) -> None:
        self._setup(config)
        self._transport = transport

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def writer(
        self,
        checkpoint: str,
        *,
        writer_id: str | None = None,
        fingerprint: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        on_mismatch: OnMismatch = "refuse",
        max_attempts: int | None = None,
        expected_sources: Iterable[str] | int | None = None,
        trace: str | os.PathLike[str] | None = None,
    ) -> Writer:
        """Create a writer of ``checkpoint``; it opens on ``with`` (or :meth:`Writer.open`).

        Args:
            checkpoint: Checkpoint name, e.g. ``curation/run-42``.
            writer_id: Defaults to ``<hostname>-<pid>``, like NeMo Curator.
            fingerprint: Named components identifying the pipeline and its input, e.g.
                ``{"pipeline": h1, "input": h2}``. The checkpoint records the first writer's; a later
                writer whose components differ is refused (:class:`FailedPrecondition` naming each
                differing component) unless ``on_mismatch`` says otherwise.
            labels: Free-form labels shown in status views. Added from the environment, under these:
                SLURM's job and array ids (``slurm_job_id``, ``slurm_array_task_id``...) and NeMo
                Curator's shard (``nemo_curator_shard_index``, ``nemo_curator_total_shards``).
            on_mismatch: ``"refuse"`` (default), ``"reset"`` (start the checkpoint over: its files go
                to the trash; refused while other writers are live) or ``"ignore"``.
            max_attempts: Set the checkpoint's failure budget when the writer opens (see
                :meth:`set_max_attempts`); None leaves it as it is.
            expected_sources: Declare the checkpoint's sources when the writer opens (see
                :meth:`declare`): their ids, or how many there are; None declares nothing.
            trace: Record every call of the writer, and what the coordinator answered, to this
                JSONL file (appended to; ``{writer_id}`` in the path is replaced by the writer id),
                for ``tally replay``. None: the ``TALLY_TRACE`` environment variable's path, if set;
                ``""``: no trace.

        Returns:
            An unopened :class:`Writer`.

        Raises:
            InvalidArgument: A bad argument (e.g. ``max_attempts`` negative), or a trace file that
                cannot be opened for appending.
        """
        spec = self._writer_spec(
            checkpoint, writer_id, fingerprint, labels, on_mismatch, max_attempts, expected_sources
        )
        writer = Writer(self._transport, spec, self._config, open_recorder(trace, spec.writer_id))
        self._writers.add(writer)
        return writer

    def are_completed(self, checkpoint: str, ids: Iterable[str]) -> list[bool]:
        """Which of ``ids`` are completed in ``checkpoint`` (live, across all writers; no writer needed).

        Args:
            checkpoint: Checkpoint name.
            ids: Source ids.

        Returns:
            One bool per id, in order.

        Raises:
            Unavailable: No answer within the timeout.
        """
        return self._run(self._are_completed_plan(checkpoint, ids))

    def cursor(self, checkpoint: str, source_id: str) -> bytes | None:
        """The cursor last saved for a source by any writer of ``checkpoint`` (see
        :meth:`Writer.save_cursor`); no writer needed.

        Returns:
            The cursor's bytes, or None: never saved, or the source is completed.

        Raises:
            InvalidArgument: An empty checkpoint name or source id.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._cursor_plan(checkpoint, source_id))

    def token_is_current(self, checkpoint: str, source_id: str, token: int) -> bool:
        """Whether a fencing token is still the live claim on a source (see :meth:`Writer.acquire`).

        An output store fences late writes with it (Kleppmann's fencing tokens): before it accepts
        a write made under a claim, it asks whether the claim's token is current, and refuses the
        write if not. A token stops being current when its source completes, its writer closes or
        loses its lease, or another writer acquires the source (with a larger token). No writer
        needed.

        Raises:
            InvalidArgument: An empty checkpoint name or source id, or a token that is not an int.
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._token_plan(checkpoint, source_id, token))

    def checkpoint(self, name: str) -> CheckpointStatus:
        """Status of one checkpoint.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._checkpoint_plan(name))

    def checkpoints(self, *, page_size: int = 1000, writers: bool = True) -> list[CheckpointStatus]:
        """Status of every checkpoint (a scoped token: those it may read), by name, fetched page by page.

        Args:
            page_size: Checkpoints fetched per call (the server takes 1 to 10,000).
            writers: False: each checkpoint's ``writers`` is empty (``live_writers`` still counts
                them). Ask so when counts are all you need: with them, every page carries every
                live writer of its checkpoints (``writers(checkpoint)`` pages through one's).

        Raises:
            Unavailable: A page did not arrive within the timeout.
        """
        return self._run(self._checkpoints_plan(page_size, writers))

    def replicas(self) -> Replicas:
        """The coordinators serving a PostgreSQL store: which owns it, which are replicas.

        Answered by whichever replica the client reaches (each reads the store's database); empty
        on the default LMDB store, which one coordinator serves.

        Raises:
            Unavailable: No answer within the timeout.
            PermissionDenied: The token is limited to some checkpoints (this lists infrastructure).
        """
        return self._run(self._replicas_plan())

    def writers(
        self,
        checkpoint: str,
        *,
        include_closed: bool = False,
        limit: int | None = 100,
        page_size: int = 1000,
    ) -> list[WriterStatus]:
        """Writers of a checkpoint: live ones by writer id, then (with ``include_closed``) ended ones,
        newest first; fetched page by page.

        Args:
            checkpoint: Checkpoint name.
            include_closed: Also list writers that closed, expired or were lost, newest first.
            limit: Most writers returned; None for every one.
            page_size: Writers fetched per call (the server takes 1 to 10,000).

        Raises:
            NotFound: No such checkpoint.
            Unavailable: A page did not arrive within the timeout.
        """
        return self._run(self._writers_plan(checkpoint, include_closed, limit, page_size))

    def events(self, checkpoint: str, *, limit: int = 50, before_id: int | None = None) -> EventPage:
        """One page of a checkpoint's events, newest first.

        Args:
            checkpoint: Checkpoint name.
            limit: Most events returned.
            before_id: Only events older than this id (``EventPage.next_before_id`` of the
                previous page); None for the newest.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._events_plan(checkpoint, limit, before_id))

    def progress(self, checkpoint: str, *, since: float | None = None) -> list[ProgressSample]:
        """A checkpoint's completed count over time, oldest first (kept across server restarts).

        Args:
            checkpoint: Checkpoint name.
            since: Only samples from this time on (seconds since the epoch); None for all kept.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._progress_plan(checkpoint, since))

    def completed(self, checkpoint: str, *, page_size: int = 10_000) -> Iterator[str]:
        """Every completed source id of a checkpoint, in byte order, fetched page by page.

        Args:
            checkpoint: Checkpoint name.
            page_size: Ids fetched per call.

        Returns:
            An iterator; each page is fetched when the previous one is used up.

        Raises:
            NotFound: No such checkpoint (when iteration starts).
            Unavailable: A page did not arrive within the timeout.
        """
        return self._completed(*self._completed_args(checkpoint, page_size))

    def declare(self, checkpoint: str, ids: Iterable[str] | None = None, *, count: int | None = None) -> int:
        """Declare a checkpoint's sources, so that its status has a total, a percent and an ETA.

        Idempotent and additive: declaring an id twice changes nothing, and each call adds to
        what earlier ones declared (several jobs may each declare their share). When the ids are
        not known up front, ``count`` says how many sources there are (the total is then at least
        that, and :meth:`remaining` has nothing to list). Ids go in calls of at most 10,000.

        Args:
            checkpoint: Checkpoint name; created if it does not exist.
            ids: The source ids, as writers will name them in ``apply_deltas``.
            count: Instead of ids: how many sources there are.

        Returns:
            The checkpoint's declared total afterwards.

        Raises:
            InvalidArgument: Both or neither of ``ids`` and ``count``, an empty id, a negative
                count, or ``ids`` is a single string.
            Unavailable: A call got no answer within the timeout.
        """
        return self._run(self._declare_plan(checkpoint, ids, count))

    def remaining(self, checkpoint: str, *, page_size: int = 1000) -> Iterator[str]:
        """Declared source ids not completed yet (:meth:`declare`), in byte order, page by page.

        Args:
            checkpoint: Checkpoint name.
            page_size: Ids fetched per call.

        Returns:
            An iterator; each page is fetched when the previous one is used up. Empty when no ids
            were declared.

        Raises:
            NotFound: No such checkpoint (when iteration starts).
            Unavailable: A page did not arrive within the timeout.
        """
        return self._remaining(*self._completed_args(checkpoint, page_size))

    def _remaining(self, name: str, page_size: int) -> Iterator[str]:
        after: str | None = ""
        while after is not None:
            page = self._send(calls.ListRemaining(name, after, page_size))
            yield from page.source_ids
            after = self._next_cursor(after, page)

    def _run(self, plan: calls.Plan[T]) -> T:
        return calls.drive(plan, self._send)

    def _send(self, call: calls.Call[T]) -> T:
        return send(self._transport, call, self._policy, Deadline(self._config.timeout))

    def _completed(self, name: str, page_size: int) -> Iterator[str]:
        after: str | None = ""
        while after is not None:
            page = self._send(calls.ListCompleted(name, after, page_size))
            yield from page.source_ids
            after = self._next_cursor(after, page)

    def failures(
        self,
        checkpoint: str,
        *,
        source_ids: Iterable[str] | None = None,
        failed_only: bool = False,
        page_size: int = 1000,
    ) -> Iterator[SourceFailures]:
        """Sources with failed attempts (:meth:`Writer.report_failure`), with their latest reasons.

        Args:
            checkpoint: Checkpoint name.
            source_ids: Only these sources (those without a failed attempt are left out), in calls
                of at most 10,000 ids; None for every source with a failed attempt, by source id,
                fetched page by page.
            failed_only: Only sources that are failed (reached the checkpoint's ``max_attempts``).
            page_size: Sources fetched per call when ``source_ids`` is None.

        Returns:
            An iterator; the calls are made as it is used.

        Raises:
            NotFound: No such checkpoint (when iteration starts).
            InvalidArgument: An empty source id, or ``source_ids`` is a single string.
            Unavailable: A call got no answer within the timeout.
        """
        args = self._failures_args(checkpoint, source_ids, page_size)
        return self._failures(*args, bool(failed_only))

    def _failures(
        self, name: str, source_ids: list[str] | None, page_size: int, failed_only: bool
    ) -> Iterator[SourceFailures]:
        if source_ids is not None:
            yield from self._run(calls.failures_of(name, source_ids, failed_only))
            return
        after: str | None = ""
        while after is not None:
            page = self._send(calls.ListFailures(name, (), failed_only, after, page_size))
            yield from page.sources
            after = self._next_failures(after, page)

    def retry_failed(self, checkpoint: str, source_ids: Iterable[str] | None = None) -> int:
        """Clear sources' failed attempts, so that they run again (not failed any more).

        Args:
            checkpoint: Checkpoint name.
            source_ids: The sources to clear; None clears every source of the checkpoint (an empty
                list clears none and makes no call).

        Returns:
            How many sources had failed attempts that were cleared.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._retry_failed_plan(checkpoint, source_ids))

    def set_max_attempts(self, checkpoint: str, max_attempts: int) -> int:
        """Set the checkpoint's failure budget: a source with that many failed attempts is failed.

        Args:
            checkpoint: Checkpoint name; created if it does not exist.
            max_attempts: 1 to 1,000,000 attempts, or 0 for unlimited (the default: no source fails).

        Returns:
            How many sources are failed under the new budget.

        Raises:
            InvalidArgument: ``max_attempts`` out of range.
            Unavailable: No answer within the timeout.
        """
        return self._run(self._set_max_attempts_plan(checkpoint, max_attempts))

    def import_completed(self, checkpoint: str, source_ids: Iterable[str], *, import_id: str) -> ImportResult:
        """Adopt completed source ids from elsewhere (e.g. a folder NeMo Curator wrote).

        The ids are written to their own completion file, ``<import_id>.mdb``, in calls of at
        most 50,000 ids. Importing the same ids again is harmless.

        Args:
            checkpoint: Checkpoint name; created if it does not exist.
            source_ids: Completed source ids.
            import_id: Names the completion file; same rules as a writer id.

        Returns:
            How many ids were new, and the checkpoint's completed count afterwards.

        Raises:
            InvalidArgument: An id or the import id was refused.
            Unavailable: A call got no answer within the timeout.
        """
        return self._run(self._import_plan(checkpoint, source_ids, import_id))

    def reset(self, checkpoint: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over: its files move to the server's trash folder (never deleted).

        Args:
            checkpoint: Checkpoint name.
            force: Close live writers instead of refusing.

        Raises:
            FailedPrecondition: Writers are live and ``force`` is False.
            NotFound: No such checkpoint.
            PermissionDenied: The token's role may not reset.
            Unavailable: No answer (not retried: the reset may have happened).
        """
        return self._run(self._reset_plan(checkpoint, force))

    def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> Iterator[CheckpointStatus]:
        """Status snapshots of a checkpoint as it changes, at most one per ``interval_s``.

        The iterator runs until you stop it (``break``, or ``close()`` it); a lost connection is
        reopened, and only a coordinator unreachable for the client's timeout ends it.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: The coordinator stayed unreachable for the timeout.
        """
        return self._watch(self._watch_call(checkpoint, interval_s))

    def _watch(self, call: calls.WatchCheckpoint) -> Iterator[CheckpointStatus]:
        retry = self._reconnect(call.checkpoint)
        while True:
            self._check_open()
            stream = self._transport.watch(call, self._config.timeout)
            try:
                for status in stream:
                    retry.received()
                    yield status
                err = self._stream_ended(call.checkpoint)
            except Unavailable as exc:
                err = exc
            finally:
                stream.close()
            time.sleep(retry.delay(err))

    def close(self) -> None:
        """Close writers still open (flushing them), then the connection. Idempotent."""
        if self._closed:
            return
        for writer in self._open_writers():
            assert isinstance(writer, Writer)
            try:
                writer.close()
            except TallyError as err:
                logger.error("closing tally writer %s with its client failed: %s", writer.writer_id, err)
        self._closed = True
        self._transport.close()
