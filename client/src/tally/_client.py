"""Client and AsyncClient over a shared base that does no I/O."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Self

from tally._config import ClientConfig, tls_files_from_env
from tally._ops import are_completed, async_are_completed, source_id_chunks
from tally._retry import Deadline, RetryPolicy, async_call_with_retry, call_with_retry
from tally._transport import AsyncTransport, Transport, make_async_transport, make_transport
from tally._types import (
    CheckpointStatus,
    CompletedPage,
    EventPage,
    ImportResult,
    ProgressSample,
    ResetResult,
    WriterSpec,
    WriterStatus,
)
from tally._writer import AsyncWriter, Writer, _WriterBase, default_writer_id
from tally.errors import FailedPrecondition, Internal, InvalidArgument, TallyError, Unavailable

logger = logging.getLogger(__name__)

# What a writer asks for when its fingerprint differs from the checkpoint's recorded one.
_ON_MISMATCH = ("refuse", "reset", "ignore")

# SLURM job identity, added to writer labels so the dashboard can tell array tasks apart.
_SLURM_LABELS = {
    "SLURM_JOB_ID": "slurm_job_id",
    "SLURM_ARRAY_JOB_ID": "slurm_array_job_id",
    "SLURM_ARRAY_TASK_ID": "slurm_array_task_id",
    "SLURM_ARRAY_TASK_COUNT": "slurm_array_task_count",
}


def _resolve_config(
    address: str | None,
    token: str | None,
    timeout: float | None,
    tls_files: Mapping[str, str | os.PathLike[str] | None],
) -> ClientConfig:
    env = ClientConfig.from_env()
    address = address or env.address
    env_files = tls_files_from_env(address)
    files = {
        name: os.fspath(given) if given is not None else env_files[name] for name, given in tls_files.items()
    }
    return ClientConfig(
        address=address,
        token=(token if token is not None else env.token) or None,
        timeout=timeout if timeout is not None else env.timeout,
        ca_cert=files["ca_cert"],
        client_cert=files["client_cert"],
        client_key=files["client_key"],
    )


# Ids per ImportCompleted call: well under the server's ids-per-call limit and gRPC's message cap.
IMPORT_CHUNK = 50_000


def _str_map(name: str, value: Mapping[str, str] | None) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidArgument(f"{name} must be a mapping of str to str, got {value!r}")
    return dict(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return value


class _Reconnect:
    """When a watch stream breaks: how long to wait before reopening it, or when to give up.

    The clock starts at the first failure after the last status received, so a watch that has
    been running for days still rides out a coordinator restart of up to ``timeout`` seconds.
    """

    def __init__(self, policy: RetryPolicy, timeout: float, what: str) -> None:
        self._policy = policy
        self._timeout = timeout
        self._what = what
        self._attempt = 0
        self._deadline: Deadline | None = Deadline(timeout)

    def received(self) -> None:
        self._attempt = 0
        self._deadline = None

    def delay(self, err: Unavailable) -> float:
        """Seconds to wait before reconnecting.

        Raises:
            Unavailable: No status arrived for ``timeout`` seconds.
        """
        if self._deadline is None:
            self._deadline = Deadline(self._timeout)
        self._attempt += 1
        delay = self._policy.delay(self._attempt)
        if self._deadline.remaining() <= delay:
            raise Unavailable(
                f"{self._what}: no answer within {self._timeout:g}s; last error: {err.message}",
                err.code,
                err.details,
            )
        return delay


class _BaseClient:
    """State and request building shared by :class:`Client` and :class:`AsyncClient` (no I/O)."""

    _writers: weakref.WeakSet[_WriterBase]

    def _setup(self, config: ClientConfig) -> None:
        self._config = config
        self._policy = RetryPolicy(config.retry_initial_s, config.retry_max_s)
        # Weak: a writer the user dropped must not be kept alive by its client.
        self._writers = weakref.WeakSet()
        self._closed = False

    @property
    def address(self) -> str:
        """The coordinator address this client talks to."""
        return self._config.address

    @property
    def config(self) -> ClientConfig:
        """The client's configuration."""
        return self._config

    def __repr__(self) -> str:
        return f"{type(self).__name__}(address={self._config.address!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"the Tally client for {self._config.address} is closed")

    def _writer_spec(
        self,
        checkpoint: str,
        writer_id: str | None,
        fingerprint: Mapping[str, str] | None,
        labels: Mapping[str, str] | None,
        on_mismatch: str = "refuse",
    ) -> WriterSpec:
        self._check_open()
        if on_mismatch not in _ON_MISMATCH:
            raise InvalidArgument(
                f"on_mismatch must be one of {', '.join(_ON_MISMATCH)}, got {on_mismatch!r}"
            )
        if not isinstance(checkpoint, str) or not checkpoint:
            raise InvalidArgument(f"checkpoint must be a non-empty string, got {checkpoint!r}")
        if writer_id is not None and (not isinstance(writer_id, str) or not writer_id):
            raise InvalidArgument(f"writer_id must be a non-empty string or None, got {writer_id!r}")
        merged = {label: os.environ[var] for var, label in _SLURM_LABELS.items() if os.environ.get(var)}
        merged.update(_str_map("labels", labels))
        return WriterSpec(
            checkpoint=checkpoint,
            writer_id=writer_id or default_writer_id(),
            fingerprint=_str_map("fingerprint", fingerprint),
            labels=merged,
            host=socket.gethostname(),
            pid=os.getpid(),
            on_mismatch=on_mismatch,
        )

    def _open_writers(self) -> list[_WriterBase]:
        return [w for w in list(self._writers) if w.health().open]

    def _name(self, checkpoint: object) -> str:
        self._check_open()
        if not isinstance(checkpoint, str) or not checkpoint:
            raise InvalidArgument(f"checkpoint must be a non-empty string, got {checkpoint!r}")
        return checkpoint

    def _retrying(self, what: str) -> tuple[RetryPolicy, Deadline, str]:
        return self._policy, Deadline(self._config.timeout), what

    @staticmethod
    def _events_args(limit: int, before_id: int | None) -> tuple[int, int | None]:
        if before_id is not None:
            _positive_int("before_id", before_id)
        return _positive_int("limit", limit), before_id

    @staticmethod
    def _since(since: float | None) -> float | None:
        if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
            raise InvalidArgument(f"since must be seconds since the epoch or None, got {since!r}")
        return None if since is None else float(since)

    @staticmethod
    def _next_cursor(after: str, page: CompletedPage) -> str | None:
        """The cursor of the next page, or None after the last one."""
        if not page.next_after:
            return None
        # A cursor that does not move forward would page forever.
        if page.next_after <= after:
            raise Internal(
                f"the coordinator's completed-ids cursor went backwards: {after!r} -> {page.next_after!r}"
            )
        return page.next_after

    @staticmethod
    def _import_batches(source_ids: Iterable[str], import_id: object) -> list[list[str]]:
        if not isinstance(import_id, str) or not import_id:
            raise InvalidArgument(f"import_id must be a non-empty string, got {import_id!r}")
        # Duplicates removed so that the per-call "imported" counts add up exactly.
        ids = list(dict.fromkeys(sid for chunk in source_id_chunks(source_ids) for sid in chunk))
        return [ids[i : i + IMPORT_CHUNK] for i in range(0, len(ids), IMPORT_CHUNK)] or [[]]

    @staticmethod
    def _interval_ms(interval_s: float) -> int:
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not interval_s > 0:
            raise InvalidArgument(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        return max(1, round(interval_s * 1000))

    def _reconnect(self, checkpoint: str) -> _Reconnect:
        return _Reconnect(self._policy, self._config.timeout, f"watch {checkpoint!r}")

    def _stream_ended(self, checkpoint: str) -> Unavailable:
        return Unavailable(f"the coordinator at {self._config.address} ended the watch of {checkpoint!r}")

    def _reset_unanswered(self, checkpoint: str, err: Unavailable) -> Unavailable:
        # A reset is not retried: it may have happened, and a second one would move new files.
        return Unavailable(
            f"reset of {checkpoint!r} got no answer ({err.message}); it may or may not have happened: "
            f"check the checkpoint's status before trying again",
            err.code,
            err.details,
        )


class Client(_BaseClient):
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
                else ``127.0.0.1:50051``.
            token: Bearer token; defaults to ``$TALLY_TOKEN``.
            timeout: Seconds each call may take, retries included; defaults to ``$TALLY_TIMEOUT``,
                else 30.
            ca_cert: PEM file of the CA that signed the coordinator's certificate (``grpcs://``,
                ``https://``); defaults to ``$TALLY_CA_CERT``, else the system's root certificates.
            client_cert: PEM certificate for a coordinator that requires client certificates
                (mutual TLS); defaults to ``$TALLY_CLIENT_CERT``.
            client_key: PEM private key of ``client_cert``; defaults to ``$TALLY_CLIENT_KEY``.

        Raises:
            ValueError: The address has an unsupported scheme, TLS files are given for a plain-text
                address, or a TLS file cannot be read.
        """
        tls_files = {"ca_cert": ca_cert, "client_cert": client_cert, "client_key": client_key}
        config = _resolve_config(address, token, timeout, tls_files)
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
        on_mismatch: str = "refuse",
    ) -> Writer:
        """Create a writer of ``checkpoint``; it opens on ``with`` (or :meth:`Writer.open`).

        Args:
            checkpoint: Checkpoint name, e.g. ``curation/run-42``.
            writer_id: Defaults to ``<hostname>-<pid>``, like NeMo Curator.
            fingerprint: Named components identifying the pipeline and its input, e.g.
                ``{"pipeline": h1, "input": h2}``. The checkpoint records the first writer's; a later
                writer whose components differ is refused (:class:`FailedPrecondition` naming each
                differing component) unless ``on_mismatch`` says otherwise.
            labels: Free-form labels shown in status views (SLURM job ids are added automatically).
            on_mismatch: ``"refuse"`` (default), ``"reset"`` (start the checkpoint over: its files go
                to the trash; refused while other writers are live) or ``"ignore"``.

        Returns:
            An unopened :class:`Writer`.
        """
        spec = self._writer_spec(checkpoint, writer_id, fingerprint, labels, on_mismatch)
        writer = Writer(self._transport, spec, self._config)
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
        self._check_open()
        return are_completed(self._transport, self._policy, self._config.timeout, checkpoint, ids)

    def checkpoint(self, name: str) -> CheckpointStatus:
        """Status of one checkpoint.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        self._check_open()
        return call_with_retry(
            lambda t: self._transport.get_checkpoint(name, t),
            self._policy,
            Deadline(self._config.timeout),
            f"get checkpoint {name!r}",
        )

    def checkpoints(self) -> list[CheckpointStatus]:
        """Status of every checkpoint.

        Raises:
            Unavailable: No answer within the timeout.
        """
        self._check_open()
        return call_with_retry(
            self._transport.list_checkpoints, self._policy, Deadline(self._config.timeout), "list checkpoints"
        )

    def writers(
        self, checkpoint: str, *, include_closed: bool = False, limit: int = 100
    ) -> list[WriterStatus]:
        """Writers of a checkpoint: live ones first, then (with ``include_closed``) ended ones.

        Args:
            checkpoint: Checkpoint name.
            include_closed: Also list writers that closed, expired or were lost, newest first.
            limit: Most writers returned.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        name, limit = self._name(checkpoint), _positive_int("limit", limit)
        return call_with_retry(
            functools.partial(self._transport.list_writers, name, bool(include_closed), limit),
            *self._retrying(f"list writers of {name!r}"),
        )

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
        name = self._name(checkpoint)
        limit, before_id = self._events_args(limit, before_id)
        return call_with_retry(
            functools.partial(self._transport.list_events, name, limit, before_id),
            *self._retrying(f"list events of {name!r}"),
        )

    def progress(self, checkpoint: str, *, since: float | None = None) -> list[ProgressSample]:
        """A checkpoint's completed count over time, oldest first (kept across server restarts).

        Args:
            checkpoint: Checkpoint name.
            since: Only samples from this time on (seconds since the epoch); None for all kept.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: No answer within the timeout.
        """
        name, since = self._name(checkpoint), self._since(since)
        return call_with_retry(
            functools.partial(self._transport.get_progress, name, since),
            *self._retrying(f"get progress of {name!r}"),
        )

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
        name, page_size = self._name(checkpoint), _positive_int("page_size", page_size)
        return self._completed(name, page_size)

    def _completed(self, name: str, page_size: int) -> Iterator[str]:
        after: str | None = ""
        while after is not None:
            page = call_with_retry(
                functools.partial(self._transport.list_completed, name, after, page_size),
                *self._retrying(f"list completed ids of {name!r}"),
            )
            yield from page.source_ids
            after = self._next_cursor(after, page)

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
        name = self._name(checkpoint)
        imported, result = 0, ImportResult(0, 0)
        for batch in self._import_batches(source_ids, import_id):
            result = call_with_retry(
                functools.partial(self._transport.import_completed, name, batch, import_id),
                *self._retrying(f"import {len(batch)} ids into {name!r}"),
            )
            imported += result.imported
        return ImportResult(imported=imported, completed_count=result.completed_count)

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
        name = self._name(checkpoint)
        try:
            return self._transport.reset_checkpoint(name, bool(force), self._config.timeout)
        except Unavailable as err:
            raise self._reset_unanswered(name, err) from None

    def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> Iterator[CheckpointStatus]:
        """Status snapshots of a checkpoint as it changes, at most one per ``interval_s``.

        The iterator runs until you stop it (``break``, or ``close()`` it); a lost connection is
        reopened, and only a coordinator unreachable for the client's timeout ends it.

        Raises:
            NotFound: No such checkpoint.
            Unavailable: The coordinator stayed unreachable for the timeout.
        """
        name, interval_ms = self._name(checkpoint), self._interval_ms(interval_s)
        return self._watch(name, interval_ms)

    def _watch(self, name: str, interval_ms: int) -> Iterator[CheckpointStatus]:
        retry = self._reconnect(name)
        while True:
            self._check_open()
            stream = self._transport.watch(name, interval_ms, self._config.timeout)
            try:
                for status in stream:
                    retry.received()
                    yield status
                err = self._stream_ended(name)
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


class AsyncClient(_BaseClient):
    """asyncio client of a Tally coordinator; the same surface as :class:`Client`, awaitable.

    Example::

        async with tally.AsyncClient() as client:
            async with client.writer("curation/run-42") as w:
                w.apply_deltas([(task_id, source_id, +1)])
                await w.flush()
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
        """Create a client; no connection is made until the first call. See :class:`Client`."""
        tls_files = {"ca_cert": ca_cert, "client_cert": client_cert, "client_key": client_key}
        config = _resolve_config(address, token, timeout, tls_files)
        self._init(config, make_async_transport(config))

    @classmethod
    def from_config(cls, config: ClientConfig) -> Self:
        """Create a client from a :class:`ClientConfig`."""
        client = cls.__new__(cls)
        client._init(config, make_async_transport(config))
        return client

    def _init(self, config: ClientConfig, transport: AsyncTransport) -> None:
        self._setup(config)
        self._transport = transport

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def writer(
        self,
        checkpoint: str,
        *,
        writer_id: str | None = None,
        fingerprint: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        on_mismatch: str = "refuse",
    ) -> AsyncWriter:
        """Create a writer of ``checkpoint``; it opens on ``async with``. See :meth:`Client.writer`."""
        spec = self._writer_spec(checkpoint, writer_id, fingerprint, labels, on_mismatch)
        writer = AsyncWriter(self._transport, spec, self._config)
        self._writers.add(writer)
        return writer

    async def are_completed(self, checkpoint: str, ids: Iterable[str]) -> list[bool]:
        """Which of ``ids`` are completed in ``checkpoint``. See :meth:`Client.are_completed`."""
        self._check_open()
        return await async_are_completed(self._transport, self._policy, self._config.timeout, checkpoint, ids)

    async def checkpoint(self, name: str) -> CheckpointStatus:
        """Status of one checkpoint. See :meth:`Client.checkpoint`."""
        self._check_open()
        return await async_call_with_retry(
            lambda t: self._transport.get_checkpoint(name, t),
            self._policy,
            Deadline(self._config.timeout),
            f"get checkpoint {name!r}",
        )

    async def checkpoints(self) -> list[CheckpointStatus]:
        """Status of every checkpoint. See :meth:`Client.checkpoints`."""
        self._check_open()
        return await async_call_with_retry(
            self._transport.list_checkpoints, self._policy, Deadline(self._config.timeout), "list checkpoints"
        )

    async def writers(
        self, checkpoint: str, *, include_closed: bool = False, limit: int = 100
    ) -> list[WriterStatus]:
        """Writers of a checkpoint. See :meth:`Client.writers`."""
        name, limit = self._name(checkpoint), _positive_int("limit", limit)
        return await async_call_with_retry(
            functools.partial(self._transport.list_writers, name, bool(include_closed), limit),
            *self._retrying(f"list writers of {name!r}"),
        )

    async def events(self, checkpoint: str, *, limit: int = 50, before_id: int | None = None) -> EventPage:
        """One page of a checkpoint's events, newest first. See :meth:`Client.events`."""
        name = self._name(checkpoint)
        limit, before_id = self._events_args(limit, before_id)
        return await async_call_with_retry(
            functools.partial(self._transport.list_events, name, limit, before_id),
            *self._retrying(f"list events of {name!r}"),
        )

    async def progress(self, checkpoint: str, *, since: float | None = None) -> list[ProgressSample]:
        """A checkpoint's completed count over time. See :meth:`Client.progress`."""
        name, since = self._name(checkpoint), self._since(since)
        return await async_call_with_retry(
            functools.partial(self._transport.get_progress, name, since),
            *self._retrying(f"get progress of {name!r}"),
        )

    def completed(self, checkpoint: str, *, page_size: int = 10_000) -> AsyncIterator[str]:
        """Every completed source id, page by page (``async for``). See :meth:`Client.completed`."""
        name, page_size = self._name(checkpoint), _positive_int("page_size", page_size)
        return self._completed(name, page_size)

    async def _completed(self, name: str, page_size: int) -> AsyncIterator[str]:
        after: str | None = ""
        while after is not None:
            page = await async_call_with_retry(
                functools.partial(self._transport.list_completed, name, after, page_size),
                *self._retrying(f"list completed ids of {name!r}"),
            )
            for sid in page.source_ids:
                yield sid
            after = self._next_cursor(after, page)

    async def import_completed(
        self, checkpoint: str, source_ids: Iterable[str], *, import_id: str
    ) -> ImportResult:
        """Adopt completed source ids from elsewhere. See :meth:`Client.import_completed`."""
        name = self._name(checkpoint)
        imported, result = 0, ImportResult(0, 0)
        for batch in self._import_batches(source_ids, import_id):
            result = await async_call_with_retry(
                functools.partial(self._transport.import_completed, name, batch, import_id),
                *self._retrying(f"import {len(batch)} ids into {name!r}"),
            )
            imported += result.imported
        return ImportResult(imported=imported, completed_count=result.completed_count)

    async def reset(self, checkpoint: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over. See :meth:`Client.reset`."""
        name = self._name(checkpoint)
        try:
            return await self._transport.reset_checkpoint(name, bool(force), self._config.timeout)
        except Unavailable as err:
            raise self._reset_unanswered(name, err) from None

    def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> AsyncIterator[CheckpointStatus]:
        """Status snapshots as the checkpoint changes (``async for``). See :meth:`Client.watch`."""
        name, interval_ms = self._name(checkpoint), self._interval_ms(interval_s)
        return self._watch(name, interval_ms)

    async def _watch(self, name: str, interval_ms: int) -> AsyncIterator[CheckpointStatus]:
        retry = self._reconnect(name)
        while True:
            self._check_open()
            stream = self._transport.watch(name, interval_ms, self._config.timeout)
            try:
                async for status in stream:
                    retry.received()
                    yield status
                err = self._stream_ended(name)
            except Unavailable as exc:
                err = exc
            finally:
                await stream.aclose()
            await asyncio.sleep(retry.delay(err))

    async def close(self) -> None:
        """Close writers still open (flushing them), then the connection. Idempotent."""
        if self._closed:
            return
        for writer in self._open_writers():
            assert isinstance(writer, AsyncWriter)
            try:
                await writer.close()
            except TallyError as err:
                logger.error("closing tally writer %s with its client failed: %s", writer.writer_id, err)
        self._closed = True
        await self._transport.close()
