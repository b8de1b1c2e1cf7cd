"""The asyncio client: the same plans as :class:`tally.Client`, sent through ``_retry.async_send``."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Self, TypeVar

from tally import _calls as calls
from tally._client.base import BaseClient, resolve_config
from tally._config import ClientConfig
from tally._retry import Deadline, async_send
from tally._trace import open_recorder
from tally._transport.base import AsyncTransport, make_async_transport
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
from tally._writer import AsyncWriter
from tally.errors import TallyError, Unavailable

logger = logging.getLogger("tally._client")

T = TypeVar("T")


class AsyncClient(BaseClient):
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
        config = resolve_config(address, token, timeout, tls_files)
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
        on_mismatch: OnMismatch = "refuse",
        max_attempts: int | None = None,
        expected_sources: Iterable[str] | int | None = None,
        trace: str | os.PathLike[str] | None = None,
    ) -> AsyncWriter:
        """Create a writer of ``checkpoint``; it opens on ``async with``. See :meth:`Client.writer`."""
        spec = self._writer_spec(
            checkpoint, writer_id, fingerprint, labels, on_mismatch, max_attempts, expected_sources
        )
        writer = AsyncWriter(self._transport, spec, self._config, open_recorder(trace, spec.writer_id))
        self._writers.add(writer)
        return writer

    async def are_completed(self, checkpoint: str, ids: Iterable[str]) -> list[bool]:
        """Which of ``ids`` are completed in ``checkpoint``. See :meth:`Client.are_completed`."""
        return await self._run(self._are_completed_plan(checkpoint, ids))

    async def cursor(self, checkpoint: str, source_id: str) -> bytes | None:
        """The cursor last saved for a source. See :meth:`Client.cursor`."""
        return await self._run(self._cursor_plan(checkpoint, source_id))

    async def token_is_current(self, checkpoint: str, source_id: str, token: int) -> bool:
        """Whether a fencing token is the live claim on a source. See :meth:`Client.token_is_current`."""
        return await self._run(self._token_plan(checkpoint, source_id, token))

    async def checkpoint(self, name: str) -> CheckpointStatus:
        """Status of one checkpoint. See :meth:`Client.checkpoint`."""
        return await self._run(self._checkpoint_plan(name))

    async def checkpoints(self, *, page_size: int = 1000, writers: bool = True) -> list[CheckpointStatus]:
        """Status of every checkpoint, page by page. See :meth:`Client.checkpoints`."""
        return await self._run(self._checkpoints_plan(page_size, writers))

    async def replicas(self) -> Replicas:
        """The coordinators serving the store. See :meth:`Client.replicas`."""
        return await self._run(self._replicas_plan())

    async def writers(
        self,
        checkpoint: str,
        *,
        include_closed: bool = False,
        limit: int | None = 100,
        page_size: int = 1000,
    ) -> list[WriterStatus]:
        """Writers of a checkpoint, page by page. See :meth:`Client.writers`."""
        return await self._run(self._writers_plan(checkpoint, include_closed, limit, page_size))

    async def events(self, checkpoint: str, *, limit: int = 50, before_id: int | None = None) -> EventPage:
        """One page of a checkpoint's events, newest first. See :meth:`Client.events`."""
        return await self._run(self._events_plan(checkpoint, limit, before_id))

    async def progress(self, checkpoint: str, *, since: float | None = None) -> list[ProgressSample]:
        """A checkpoint's completed count over time. See :meth:`Client.progress`."""
        return await self._run(self._progress_plan(checkpoint, since))

    def completed(self, checkpoint: str, *, page_size: int = 10_000) -> AsyncIterator[str]:
        """Every completed source id, page by page (``async for``). See :meth:`Client.completed`."""
        return self._completed(*self._completed_args(checkpoint, page_size))

    async def declare(
        self, checkpoint: str, ids: Iterable[str] | None = None, *, count: int | None = None
    ) -> int:
        """Declare a checkpoint's sources (or how many). See :meth:`Client.declare`."""
        return await self._run(self._declare_plan(checkpoint, ids, count))

    def remaining(self, checkpoint: str, *, page_size: int = 1000) -> AsyncIterator[str]:
        """Declared ids not completed yet (``async for``). See :meth:`Client.remaining`."""
        return self._remaining(*self._completed_args(checkpoint, page_size))

    async def _remaining(self, name: str, page_size: int) -> AsyncIterator[str]:
        after: str | None = ""
        while after is not None:
            page = await self._send(calls.ListRemaining(name, after, page_size))
            for sid in page.source_ids:
                yield sid
            after = self._next_cursor(after, page)

    async def _run(self, plan: calls.Plan[T]) -> T:
        return await calls.async_drive(plan, self._send)

    async def _send(self, call: calls.Call[T]) -> T:
        return await async_send(self._transport, call, self._policy, Deadline(self._config.timeout))

    async def _completed(self, name: str, page_size: int) -> AsyncIterator[str]:
        after: str | None = ""
        while after is not None:
            page = await self._send(calls.ListCompleted(name, after, page_size))
            for sid in page.source_ids:
                yield sid
            after = self._next_cursor(after, page)

    def failures(
        self,
        checkpoint: str,
        *,
        source_ids: Iterable[str] | None = None,
        failed_only: bool = False,
        page_size: int = 1000,
    ) -> AsyncIterator[SourceFailures]:
        """Sources with failed attempts (``async for``). See :meth:`Client.failures`."""
        args = self._failures_args(checkpoint, source_ids, page_size)
        return self._failures(*args, bool(failed_only))

    async def _failures(
        self, name: str, source_ids: list[str] | None, page_size: int, failed_only: bool
    ) -> AsyncIterator[SourceFailures]:
        if source_ids is not None:
            for found in await self._run(calls.failures_of(name, source_ids, failed_only)):
                yield found
            return
        after: str | None = ""
        while after is not None:
            page = await self._send(calls.ListFailures(name, (), failed_only, after, page_size))
            for found in page.sources:
                yield found
            after = self._next_failures(after, page)

    async def retry_failed(self, checkpoint: str, source_ids: Iterable[str] | None = None) -> int:
        """Clear sources' failed attempts. See :meth:`Client.retry_failed`."""
        return await self._run(self._retry_failed_plan(checkpoint, source_ids))

    async def set_max_attempts(self, checkpoint: str, max_attempts: int) -> int:
        """Set the checkpoint's failure budget. See :meth:`Client.set_max_attempts`."""
        return await self._run(self._set_max_attempts_plan(checkpoint, max_attempts))

    async def import_completed(
        self, checkpoint: str, source_ids: Iterable[str], *, import_id: str
    ) -> ImportResult:
        """Adopt completed source ids from elsewhere. See :meth:`Client.import_completed`."""
        return await self._run(self._import_plan(checkpoint, source_ids, import_id))

    async def reset(self, checkpoint: str, *, force: bool = False) -> ResetResult:
        """Start a checkpoint over. See :meth:`Client.reset`."""
        return await self._run(self._reset_plan(checkpoint, force))

    def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> AsyncIterator[CheckpointStatus]:
        """Status snapshots as the checkpoint changes (``async for``). See :meth:`Client.watch`."""
        return self._watch(self._watch_call(checkpoint, interval_s))

    async def _watch(self, call: calls.WatchCheckpoint) -> AsyncIterator[CheckpointStatus]:
        retry = self._reconnect(call.checkpoint)
        while True:
            self._check_open()
            stream = self._transport.watch(call, self._config.timeout)
            try:
                async for status in stream:
                    retry.received()
                    yield status
                err = self._stream_ended(call.checkpoint)
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
