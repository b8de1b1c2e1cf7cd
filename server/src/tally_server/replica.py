"""A replica of a PostgreSQL store: serves while another coordinator owns the store.

Several ``tally serve`` given one ``--store`` form one service. The one holding the store's lock (the
*owner*, see ``store.postgres.StoreLock``) applies every writer's deltas; each other one runs as a
replica until it takes the lock itself:

- Reads are answered here (:data:`LOCAL_CALLS`, over gRPC and HTTP alike, by the owner's own
  servicer and routes over :class:`ReplicaReads`, so tokens, validation, errors and answers are the
  same):

  - ``AreCompleted``, ``ListCompleted`` (and ``GetCursor``'s check) from the database's committed
    completions (``AreCompleted`` partly from this replica's cache of ids it has seen completed,
    which is never staler than the database: ``replica_cache``). A completion
    is committed before the owner counts it completed, and an un-complete (an anomaly) is committed
    before the ``ApplyDeltas`` that caused it is answered, so a replica never says completed what
    the owner would not, and a flushed completion is seen by every replica at once.
  - ``GetCheckpoint``, ``ListCheckpoints`` and the live writers of ``ListWriters`` from the statuses
    the owner publishes (``store.pg_status``: at most about half a second behind its memory); a
    checkpoint not published yet is asked of the owner.
  - Past writers, ``ListEvents`` and ``GetProgress``'s samples from the registry, which the owner
    writes behind its answers (also about half a second); ``GetCursor`` from the registry too (a
    cursor is saved there before ``SaveCursors`` is answered); ``ListReplicas`` from
    ``store_replicas``.
- Every other gRPC call (writes, claims, failures, totals, ``WatchCheckpoint``), and every other
  HTTP request except the probes and ``/metrics``, is forwarded to the owner as it came (bytes,
  metadata, bearer token): the owner checks and answers it.
- The probes say ready while the owner is known and alive; ``/metrics`` shows this replica's own
  series (``tally_replica_*``).

When the owner goes (exit, kill -9, or silent past ``TAKE_OVER_AFTER_S``), the replica takes the
lock, stops these servers and starts the full coordinator on the same ports, with the writers'
journals: the writers re-attach, through any replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import grpc
import httpx
import psycopg
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.routing import APIRoute
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Gauge, Histogram, generate_latest
from pydantic import TypeAdapter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tally.v1 import coordinator_pb2 as pb
from tally_server import logs
from tally_server.auth import Authorizer
from tally_server.domain import validation
from tally_server.domain.ports import Registry, SourceFailuresRecord
from tally_server.domain.validation import Limits
from tally_server.errors import ErrorCode, Unavailable
from tally_server.grpc_api.auth import AuthInterceptor
from tally_server.grpc_api.errors import ErrorInterceptor
from tally_server.grpc_api.request_context import REQUEST_ID_KEY, RequestInterceptor
from tally_server.grpc_api.server import SERVICE_NAME
from tally_server.grpc_api.servicer import CoordinatorServicer
from tally_server.http_api.auth import Guard, declared_operation
from tally_server.http_api.body_limit import BodyLimit
from tally_server.http_api.errors import error_response, install_handlers
from tally_server.http_api.request_context import RequestMiddleware
from tally_server.http_api.routes import admin, checkpoints, failures, status, totals
from tally_server.listen import add_grpc_port
from tally_server.metrics import CONTENT_TYPE, LATENCY_BUCKETS, new_registry
from tally_server.replica_cache import CompletedCache
from tally_server.service import CoordinatorService
from tally_server.service.failures import failures_limit
from tally_server.service.status import (
    completed_limit,
    event_page,
    events_limit,
    watching,
    writer_page,
    writer_position,
)
from tally_server.service.totals import DEFAULT_PAGE as REMAINING_PAGE
from tally_server.service.views import (
    CheckpointPage,
    CheckpointView,
    CompletedPage,
    CursorView,
    EventPage,
    FailurePage,
    ProgressSample,
    ReplicasView,
    ReplicaView,
    SourceFailuresView,
    WriterPage,
)
from tally_server.store.pg_arrays import bytea_array
from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import (
    TRANSIENT,
    TRANSIENT_RAW,
    cause,
    create_engine,
    display,
    read_error,
    stale_connection,
)
from tally_server.store.replicas import Owner, ReplicaBoard, ReplicaNameInUse

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_PREFIX = "/tally.v1.Coordinator/"
_STREAMS = frozenset({"WatchCheckpoint"})
# Set on every call a replica forwards: a replica that receives one refuses to forward it again
# (two coordinators sharing a name, or a stale address, would otherwise pass it around for ever).
FORWARDED_BY = "tally-forwarded-by"
# Metadata a forwarded call does not carry over: HTTP/2 pseudo-headers and the transport's own.
_NOT_FORWARDED = ("user-agent", "grpc-", ":")
# HTTP headers a forwarded request or answer does not carry over (hop-by-hop, or set anew).
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# ... and the request id: each side's middleware sets it (the same one: the replica sends its own on).
_SET_ANEW = _HOP_BY_HOP | {REQUEST_ID_KEY}
# The tally.v1 calls a replica answers itself (over HTTP too: the routes that serve them); every
# other one is forwarded to the store's owner.
LOCAL_CALLS = frozenset(
    {
        "AreCompleted",
        "ListCompleted",
        "GetCursor",
        "GetCheckpoint",
        "ListCheckpoints",
        "ListWriters",
        "ListEvents",
        "GetProgress",
        "ListReplicas",
        "WatchCheckpoint",
        "ListFailures",
        "ListRemaining",
    }
)
_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
_VIEW = TypeAdapter(CheckpointView)
_COMPLETED_AFTER = sa.text(
    "SELECT DISTINCT source_id FROM completed WHERE checkpoint = :checkpoint AND source_id > :after "
    "ORDER BY source_id LIMIT :limit"
)
# The asked ids that have a committed completion in the checkpoint: one index probe per id asked, by
# the shape of the query (a subquery per id, which the planner cannot turn into a scan of the
# checkpoint). ``source_id = ANY(ids)`` leaves that choice to the planner: on a table not analyzed
# yet, its prepared (generic) plan scanned the checkpoint's rows and compared each with every id
# asked, 0.1-0.3 s for 1,000 ids among 4,000 rows, and worse the bigger the checkpoint. Sent by
# psycopg itself with binary parameters: the ids go as one bytea[] (no per-id escaping), the matches
# come back as one bytea[] value, and psycopg prepares the statement on each connection after a few
# calls. Through SQLAlchemy (its compile, a bind processor per id, text escaping of each id, a ping
# and a ROLLBACK per call) the replica spent about three times the CPU on the same call.
_ARE_COMPLETED = (
    "SELECT array_agg(t.id) FROM unnest(%b::bytea[]) AS t(id) WHERE (SELECT true FROM completed c "
    "WHERE c.checkpoint = %b AND c.source_id = t.id LIMIT 1)"
)
# The same with the replica's cache (``replica_cache``), in one statement, so one snapshot: the
# checkpoint's ``uncompleted`` number now, the ids the cache lacks that are completed, and the ids
# it holds that are completed if the number is not the one they are held under (else those are not
# looked up: a one-time filter skips their probes). Parameters: the lacking ids, the checkpoint,
# the held ids, the number they are held under (NULL: none), the checkpoint twice more.
_PROBE = "(SELECT true FROM completed c WHERE c.checkpoint = %b AND c.source_id = t.id LIMIT 1)"
_ARE_COMPLETED_CACHED = (
    "SELECT n.uncompleted, "
    f"(SELECT array_agg(t.id) FROM unnest(%b::bytea[]) AS t(id) WHERE {_PROBE}), "
    "(SELECT array_agg(t.id) FROM unnest(%b::bytea[]) AS t(id) "
    f"WHERE n.uncompleted IS DISTINCT FROM %b::int8 AND {_PROBE}) "
    "FROM (SELECT (SELECT uncompleted FROM completion_checkpoints WHERE checkpoint = %b) AS uncompleted) AS n"
)


class OwnerRoute:
    """Where the store's owner is, as last read from the database (refreshed every poll)."""

    def __init__(self) -> None:
        self.owner: Owner | None = None
        self.problem: str | None = "the store's owner is not known yet"

    def update(self, owner: Owner | None, problem: str | None = None) -> None:
        """Record a fresh read of the owner (or why it could not be read)."""
        if problem is None and owner is None:
            problem = "no coordinator owns the store yet"
        elif problem is None and owner is not None and not owner.grpc_address:
            problem = f"the store's owner {owner.name} has not said where to reach it"
        elif problem is None and owner is not None and not owner.alive:
            problem = f"the store's owner {owner.name} has not shown it is alive for {owner.silent_s:.0f} s"
        if owner is not None:
            self.owner = owner
        self.problem = problem

    def current(self) -> Owner:
        """The owner to forward to.

        Raises:
            Unavailable: there is none to forward to now (the caller retries; a takeover is under way).
        """
        owner = self.owner
        if owner is None or not owner.grpc_address:
            raise Unavailable(
                f"this replica cannot forward the call: {self.problem}; retry in a few seconds (a replica "
                "takes the store over within seconds when its owner is gone)"
            )
        return owner


class CompletedReader:
    """Reads of the database's committed completions (a pooled engine, called from worker threads).

    Each read is one statement in autocommit, on its own snapshot of committed rows, on a pooled
    connection lent without a ping: a connection a database restart cut fails its read, which then
    runs once more on a new pool (reads are idempotent).

    ``are_completed`` keeps the completed ids it has read in ``cache`` (``replica_cache``: whole
    checkpoints, under each checkpoint's ``uncompleted`` number) and asks the database only for the
    ids it lacks, with the number, in one statement; ``replica_cache`` says why an id answered from
    the cache is one the database still holds completed.
    """

    def __init__(
        self, url: sa.URL, cache: CompletedCache | None = None, metrics: ReplicaMetrics | None = None
    ) -> None:
        self.url = url
        self._engine = create_engine(url, pre_ping=False, autocommit=True)
        self.cache = cache if cache is not None else CompletedCache(0)
        self._metrics = metrics
        if metrics is not None:
            metrics.cache_ids.set_function(lambda: self.cache.size)

    def are_completed(self, checkpoint: str, source_ids: Sequence[str]) -> list[bool]:
        """Parallel booleans: whether each id has a committed completion in the checkpoint.

        Raises:
            StoreUnavailable: the database cannot be read now (UNAVAILABLE: retry).
        """
        keys = list(map(str.encode, source_ids))
        if not keys:
            return []
        if self.cache.max_ids == 0:
            return self._uncached(checkpoint, keys)
        asked = self.cache.ask(checkpoint, keys)
        params = (
            bytea_array(asked.lacking),
            checkpoint,
            bytea_array(asked.held),
            asked.number,
            checkpoint,
            checkpoint,
        )

        def query(conn: sa.Connection) -> tuple[int | None, list[bytes] | None, list[bytes] | None]:
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            with raw.cursor(binary=True) as cursor:
                row = cursor.execute(_ARE_COMPLETED_CACHED, params).fetchone()
            assert row is not None  # one row, always
            return row[0], row[1], row[2]

        number, lacking, held = self._read(query, checkpoint)
        settled = self.cache.settle(checkpoint, keys, asked, number, {*(lacking or ()), *(held or ())})
        if self._metrics is not None:
            self._metrics.cache_hits.inc(settled.hits)
            self._metrics.cache_misses.inc(len(keys) - settled.hits)
            if settled.dropped:
                self._metrics.cache_dropped.inc()
            if settled.evicted:
                self._metrics.cache_evicted.inc(settled.evicted)
        return settled.answers

    def _uncached(self, checkpoint: str, keys: list[bytes]) -> list[bool]:
        def query(conn: sa.Connection) -> list[bytes] | None:
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            with raw.cursor(binary=True) as cursor:
                row = cursor.execute(_ARE_COMPLETED, (bytea_array(keys), checkpoint)).fetchone()
            return None if row is None else row[0]

        done = set(self._read(query, checkpoint) or ())
        if self._metrics is not None:
            self._metrics.cache_misses.inc(len(keys))
        return list(map(done.__contains__, keys))

    def completed_after(self, checkpoint: str, after: str, limit: int) -> list[str]:
        """Up to ``limit`` committed completed ids of the checkpoint after ``after``, in byte order.

        Raises:
            StoreUnavailable: the database cannot be read now (UNAVAILABLE: retry).
        """
        params = {"checkpoint": checkpoint, "after": after.encode(), "limit": limit}

        def query(conn: sa.Connection) -> Sequence[bytes]:
            return conn.execute(_COMPLETED_AFTER, params).scalars().all()

        return [bytes(k).decode(errors="replace") for k in self._read(query, checkpoint)]

    def _read(self, query: Callable[[sa.Connection], _T], checkpoint: str) -> _T:
        for again in (True, False):
            try:
                with self._engine.connect() as conn:
                    return query(conn)
            except TRANSIENT_RAW as exc:
                if again and stale_connection(exc):
                    # A database restart cut the pooled connections: a new pool, then once more.
                    log.info(
                        "a pooled connection to %s was closed (%s); reading again",
                        display(self.url),
                        cause(exc),
                    )
                    self._engine.dispose()
                    continue
                raise read_error(self.url, exc, f"the completions of checkpoint {checkpoint!r}") from None
        raise AssertionError("unreachable: the second try returns or raises")

    def close(self) -> None:
        """Close the reader's connections."""
        self._engine.dispose()


def published_views(statuses: Mapping[str, Any]) -> dict[str, CheckpointView]:
    """Statuses as the owners publish them (``StatusBoard.statuses``), as views."""
    return {name: _VIEW.validate_python(status) for name, status in statuses.items()}


def _failure_source(record: SourceFailuresRecord) -> str:
    return record.source_id


class ForwardToOwner(Exception):
    """A read this replica leaves to the owner: the checkpoint has no published status (yet)."""


class ReplicaReads:
    """The reads a replica answers itself, under the coordinator service's names and signatures.

    The owner's gRPC servicer and HTTP routes call these, so a replica checks, refuses and answers
    exactly as the owner does. Status comes from what the owner published (``store.pg_status``),
    history from the registry, completions from the committed rows. A checkpoint with no published
    status raises :class:`ForwardToOwner`: the call goes to the owner, which knows (the checkpoint may
    have been created within the last half second).
    """

    def __init__(
        self,
        limits: Limits,
        reader: CompletedReader,
        board: StatusBoard,
        registry: Registry,
        listing: Callable[[], ReplicasView],
        metrics: ReplicaMetrics,
    ) -> None:
        self.limits = limits
        self._reader, self._board, self._registry = reader, board, registry
        self._listing, self._metrics = listing, metrics

    def checkpoint_of(self, handle: str) -> str | None:
        """None: writer handles are the owner's (calls naming one are forwarded)."""
        return None

    def _answered(self, call: str) -> None:
        self._metrics.local_calls.labels(call).inc()

    async def _view(self, name: str) -> CheckpointView:
        validation.checkpoint_name(name, self.limits)
        found = (await asyncio.to_thread(self._board.statuses, [name])).get(name)
        if found is None:
            raise ForwardToOwner(name)
        return _VIEW.validate_python(found)

    async def are_completed(self, checkpoint: str, source_ids: Sequence[str]) -> list[bool]:
        """Parallel booleans from the committed completions (and the cache of them, see ``replica_cache``)."""
        validation.checkpoint_name(checkpoint, self.limits)
        ids = validation.source_ids(source_ids, self.limits)
        done = await asyncio.to_thread(self._reader.are_completed, checkpoint, ids)
        self._metrics.local_reads.inc()
        self._answered("AreCompleted")
        return done

    async def list_completed(self, checkpoint: str, *, after: str = "", limit: int = 10_000) -> CompletedPage:
        """A page of committed completed ids in byte order after ``after``."""
        await self._view(checkpoint)
        completed_limit(limit, self.limits)
        ids = await asyncio.to_thread(self._reader.completed_after, checkpoint, after, limit + 1)
        page = ids[:limit]
        self._answered("ListCompleted")
        return CompletedPage(page, page[-1] if len(ids) > limit and page else "")

    async def get_cursor(self, checkpoint: str, source_id: str) -> CursorView:
        """The cursor last saved for a source; none once the source's completion is committed.

        From the registry (a cursor is saved there before ``SaveCursors`` is answered); the owner
        deletes the cursors of completed sources when it sees them, a replica only leaves them out.
        """
        validation.checkpoint_name(checkpoint, self.limits)
        validation.source_id(source_id, self.limits)
        record = await asyncio.to_thread(self._registry.get_cursor, checkpoint, source_id)
        found = record is not None
        if record is not None:
            (done,) = await asyncio.to_thread(self._reader.are_completed, checkpoint, [source_id])
            found = not done
        self._answered("GetCursor")
        if record is None or not found:
            return CursorView(False)
        return CursorView(True, record.data, record.saved_at, record.writer_id)

    async def get_checkpoint(self, name: str) -> CheckpointView:
        """One checkpoint's status as the owner last published it."""
        view = await self._view(name)
        self._answered("GetCheckpoint")
        return view

    async def list_failures(
        self,
        checkpoint: str,
        *,
        source_ids: Sequence[str] = (),
        failed_only: bool = False,
        after: str = "",
        limit: int = 0,
    ) -> FailurePage:
        """Sources with failed attempts, from the registry, less those whose completion is committed.

        The registry holds every failure before its ``ReportFailure`` is answered; the owner clears
        a source's failures when it completes, which a replica sees as the committed completion.
        """
        validation.checkpoint_name(checkpoint, self.limits)
        limit = failures_limit(limit, self.limits)
        asked = validation.source_ids(list(source_ids), self.limits) if source_ids else None
        await self._view(checkpoint)
        budget = await asyncio.to_thread(self._registry.budget_of, checkpoint)
        page: list[SourceFailuresRecord] = []
        more = False
        if failed_only and not budget:
            pass  # no budget: no source is failed
        elif asked is not None:
            records = await asyncio.to_thread(self._registry.list_failures, checkpoint, sorted(set(asked)))
            kept = [r for r in records if not failed_only or r.attempts >= budget]
            page = sorted(await self._uncompleted(checkpoint, kept, _failure_source), key=_failure_source)
        else:
            least = budget if failed_only else 0
            page, more = await self._uncompleted_page(
                checkpoint,
                lambda cursor, n: self._registry.failures_after(checkpoint, cursor, n, least),
                _failure_source,
                after,
                limit,
            )
        views = [
            SourceFailuresView(r.source_id, r.attempts, bool(budget) and r.attempts >= budget, list(r.recent))
            for r in page
        ]
        self._answered("ListFailures")
        return FailurePage(views, page[-1].source_id if more and page else "", budget)

    async def list_remaining(self, checkpoint: str, *, after: str = "", limit: int = 0) -> CompletedPage:
        """A page of declared sources (the registry's) not completed (committed), by code point."""
        limit = limit or REMAINING_PAGE
        completed_limit(limit, self.limits)
        await self._view(checkpoint)
        page, more = await self._uncompleted_page(
            checkpoint,
            lambda cursor, n: self._registry.declared_after(checkpoint, cursor, n),
            str,
            after,
            limit,
        )
        self._answered("ListRemaining")
        return CompletedPage(page, page[-1] if more else "")

    async def _uncompleted(
        self, checkpoint: str, items: list[_T], source_of: Callable[[_T], str]
    ) -> list[_T]:
        """The ``items`` whose source has no committed completion."""
        if not items:
            return []
        done = await asyncio.to_thread(self._reader.are_completed, checkpoint, list(map(source_of, items)))
        return [item for item, completed in zip(items, done, strict=True) if not completed]

    async def _uncompleted_page(
        self,
        checkpoint: str,
        fetch: Callable[[str, int], list[_T]],
        source_of: Callable[[_T], str],
        after: str,
        limit: int,
    ) -> tuple[list[_T], bool]:
        """Up to ``limit`` items after ``after`` whose source is not completed, and whether more follow.

        ``fetch(cursor, n)`` gives up to ``n`` items after ``cursor``, in order (a registry query).
        """
        page: list[_T] = []
        cursor = after
        while len(page) <= limit:  # one more than asked: is there a next page
            batch = await asyncio.to_thread(fetch, cursor, limit + 1)
            if batch:
                cursor = source_of(batch[-1])
                page += await self._uncompleted(checkpoint, batch, source_of)
            if len(batch) <= limit:
                break
        return page[:limit], len(page) > limit

    async def watch(self, checkpoint: str, *, interval_s: float = 1.0) -> AsyncIterator[CheckpointView]:
        """The published status now and whenever it changes (polled every ``interval_s``).

        Raises :class:`ForwardToOwner` before the first snapshot if the checkpoint has no published
        status; ends once its status is no longer published (the checkpoint was deleted).
        """
        first: CheckpointView | None = await self._view(checkpoint)
        self._answered("WatchCheckpoint")

        async def read() -> CheckpointView | None:
            nonlocal first
            if first is not None:
                view, first = first, None
                return view
            try:
                return await self._view(checkpoint)
            except ForwardToOwner:
                return None

        async for view in watching(read, interval_s, lambda: True):
            yield view

    async def list_checkpoints(
        self,
        *,
        after: str = "",
        limit: int = 0,
        visible: Callable[[str], bool] = lambda name: True,
        writers: bool = True,
    ) -> CheckpointPage:
        """A page of the published checkpoints ``visible`` lets through, by name in byte order.

        ``writers`` False: without their live writers (counted only).
        """
        limit = validation.status_page_limit(limit, "checkpoints")
        validation.checkpoint_after(after, self.limits)
        start = after.encode()
        names = sorted(
            (n for n in await asyncio.to_thread(self._board.names) if n.encode() > start and visible(n)),
            key=str.encode,
        )
        found = await asyncio.to_thread(self._board.statuses, names[:limit])
        # Without writers: left out before the published JSON is read into a view, not after.
        page = [
            _VIEW.validate_python(found[n] if writers else {**found[n], "writers": []})
            for n in names[:limit]
            if n in found
        ]
        self._answered("ListCheckpoints")
        return CheckpointPage(page, page[-1].name if len(names) > limit and page else "")

    async def list_writers(
        self, checkpoint: str, *, include_closed: bool = False, after: str = "", limit: int = 0
    ) -> WriterPage:
        """Live writers (as published), then (``include_closed``) past ones from the registry."""
        limit = validation.status_page_limit(limit, "writers")
        start = writer_position(after) if after else None
        view = await self._view(checkpoint)
        records = await asyncio.to_thread(self._registry.list_writers, checkpoint) if include_closed else []
        self._answered("ListWriters")
        return writer_page(view.writers, records, start, limit)

    async def list_events(self, checkpoint: str, *, limit: int = 50, before_id: int = 0) -> EventPage:
        """The checkpoint's events newest first, from the registry."""
        await self._view(checkpoint)
        events_limit(limit)
        validation.before_id(before_id)
        records = await asyncio.to_thread(
            lambda: self._registry.list_events(checkpoint, limit=limit + 1, before_id=before_id or None)
        )
        self._answered("ListEvents")
        return event_page(records, limit)

    async def progress(self, checkpoint: str, *, since: float = 0.0) -> list[ProgressSample]:
        """The registry's samples, then the published count now."""
        view = await self._view(checkpoint)
        records = await asyncio.to_thread(lambda: self._registry.list_samples(checkpoint, since=since))
        samples = [ProgressSample(r.at, r.completed_count) for r in records]
        samples.append(ProgressSample(time.time(), view.completed_count))
        self._answered("GetProgress")
        return samples

    async def list_replicas(self) -> ReplicasView:
        """The store's replicas and epoch, from the database."""
        view = await asyncio.to_thread(self._listing)
        self._answered("ListReplicas")
        return view


class ReplicaMetrics:
    """A replica's own series (the owner's are on the owner's ``/metrics``)."""

    def __init__(self, name: str, route: OwnerRoute) -> None:
        self.registry = new_registry()
        self.forwarded = Counter(
            "tally_replica_forwarded_calls",
            "Calls this replica forwarded to the store's owner, by transport and outcome.",
            ["transport", "outcome"],
            registry=self.registry,
        )
        self.local_reads = Counter(
            "tally_replica_are_completed_calls",
            "are_completed calls this replica answered from the database itself.",
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "tally_replica_cache_hits",
            "Ids asked of this replica (are_completed, and the completed checks of its other reads) "
            "answered from its cache of completed ids, without asking the database.",
            registry=self.registry,
        )
        self.cache_misses = Counter(
            "tally_replica_cache_misses",
            "Ids asked of this replica that it looked up in the database (not in its cache, or the "
            "checkpoint's cache could be stale).",
            registry=self.registry,
        )
        self.cache_dropped = Counter(
            "tally_replica_cache_dropped",
            "Times a checkpoint's cached ids were dropped because one of its completions went (a reset, "
            "a delete, an anomaly) or the checkpoint is gone.",
            registry=self.registry,
        )
        self.cache_evicted = Counter(
            "tally_replica_cache_evicted",
            "Checkpoints evicted from this replica's cache to keep it within replica_cache_ids.",
            registry=self.registry,
        )
        self.cache_ids = Gauge(
            "tally_replica_cache_ids",
            "Completed ids held in this replica's cache, over every checkpoint.",
            registry=self.registry,
        )
        self.local_calls = Counter(
            "tally_replica_local_calls",
            "Reads this replica answered itself (gRPC and HTTP), by tally.v1 call.",
            ["call"],
            registry=self.registry,
        )
        # Named apart from the owner's tally_*_request_duration_seconds: a forwarded call is timed
        # here and at the owner, and sums over instances must not count it twice.
        self.grpc_request_duration = Histogram(
            "tally_replica_grpc_request_duration_seconds",
            "Time for this replica to answer a unary gRPC call (itself or through the owner), by full "
            "method name and status code.",
            ["method", "code"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.http_request_duration = Histogram(
            "tally_replica_http_request_duration_seconds",
            "Time for this replica to answer an HTTP request (itself or through the owner), by method, "
            "route template (/{path:path} for forwarded requests) and status.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        info = Gauge(
            "tally_replica_up",
            "1 on a replica of a PostgreSQL store that does not own it (0 series on the owner), with "
            "the store's owner as last read.",
            ["replica", "owner"],
            registry=self.registry,
        )
        self._info, self._name, self._route = info, name, route

    def exposition(self) -> bytes:
        """The Prometheus text of this replica's series."""
        self._info.clear()
        owner = self._route.owner
        self._info.labels(self._name, owner.name if owner is not None else "").set(1)
        return generate_latest(self.registry)


def _forwarded_metadata(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """The caller's metadata to send on, with this call's request id (so the owner logs the same one)."""
    kept = [(k, v) for k, v in metadata or () if not k.startswith(_NOT_FORWARDED) and k != REQUEST_ID_KEY]
    return [*kept, (REQUEST_ID_KEY, logs.request_id.get())]


class GrpcForwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """``tally.v1.Coordinator`` on a replica: reads here (``LOCAL_CALLS``), the rest at the owner."""

    def __init__(
        self,
        route: OwnerRoute,
        reads: ReplicaReads,
        authorizer: Authorizer,
        metrics: ReplicaMetrics,
        channel_for: Callable[[str], grpc.aio.Channel],
        name: str,
    ) -> None:
        self._name = name
        self._route = route
        self.metrics = metrics
        self.relay = Relay(name, channel_for, metrics.forwarded)
        # The owner's servicer and token checks, over this replica's reads.
        self._servicer = CoordinatorServicer(cast(CoordinatorService, reads))
        self._auth = AuthInterceptor(authorizer, reads.checkpoint_of)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        """The handler of one method: None outside tally.v1 and for a method it does not have."""
        method: str = handler_call_details.method
        if not method.startswith(_PREFIX):
            return None
        name = method[len(_PREFIX) :]
        if name not in _SERVICE.methods_by_name:
            return None  # UNIMPLEMENTED here, as at the owner: nothing unknown is forwarded
        if name in LOCAL_CALLS:
            header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
            if isinstance(header, bytes):
                header = header.decode("latin-1")
            local = self._local_stream(name) if name in _STREAMS else self._local(name)
            return self._auth.guard(name, header, local)
        if name in _STREAMS:
            return grpc.unary_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _local(self, name: str) -> Any:
        """The servicer's handler of ``name``; a checkpoint not published yet is asked of the owner."""
        rpc = _SERVICE.methods_by_name[name]
        request_type, response_type = getattr(pb, rpc.input_type.name), getattr(pb, rpc.output_type.name)
        answer = getattr(self._servicer, name)
        forward = self._unary(_PREFIX + name)

        async def local(request: Any, context: Any) -> Any:
            try:
                return await answer(request, context)
            except ForwardToOwner:
                return response_type.FromString(await forward(request.SerializeToString(), context))

        return grpc.unary_unary_rpc_method_handler(
            local,
            request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString,
        )

    def _local_stream(self, name: str) -> Any:
        """``_local`` of a streaming call: the owner's stream if the first answer is not known here."""
        rpc = _SERVICE.methods_by_name[name]
        request_type, response_type = getattr(pb, rpc.input_type.name), getattr(pb, rpc.output_type.name)
        answer = getattr(self._servicer, name)
        forward = self._stream(_PREFIX + name)

        async def local(request: Any, context: Any) -> AsyncIterator[Any]:
            stream = answer(request, context)
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                return
            except ForwardToOwner:
                async for item in forward(request.SerializeToString(), context):
                    yield response_type.FromString(item)
                return
            yield first
            async for item in stream:
                yield item

        return grpc.unary_stream_rpc_method_handler(
            local,
            request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString,
        )

    def _unary(self, method: str) -> Callable[[bytes, Any], Any]:
        async def forward(request: bytes, context: Any) -> bytes:
            return await self.relay.unary(method, self._route.current, request, context)

        return forward

    def _stream(self, method: str) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
        def forward(request: bytes, context: Any) -> AsyncIterator[bytes]:
            return self.relay.stream(method, self._route.current, request, context)

        return forward


class Relay:
    """Sends a gRPC call on as it came (bytes, metadata, bearer token) and answers with what comes back.

    Used by a replica for the calls its owner answers (``GrpcForwarder``) and, on a store of several
    shards, by every coordinator for the calls of shards another one owns (``sharding``).

    Args:
        name: this coordinator's replica name (sent along, so a call is never forwarded twice).
        channel_for: the channel to an address.
        forwarded: counts calls by transport and outcome (``ok``, ``refused``, ``unreachable``).
    """

    def __init__(self, name: str, channel_for: Callable[[str], grpc.aio.Channel], forwarded: Counter) -> None:
        self._name = name
        self._channel_for = channel_for
        self._forwarded = forwarded

    def _target(
        self, context: Any, owner_of: Callable[[], Owner]
    ) -> tuple[Owner, grpc.aio.Channel, list[tuple[str, Any]]]:
        metadata = _forwarded_metadata(context.invocation_metadata())
        came_from = next((v for k, v in metadata if k == FORWARDED_BY), None)
        if came_from is not None:
            raise Unavailable(_loop(came_from, self._name))
        owner = owner_of()
        return owner, self._channel_for(owner.grpc_address), [*metadata, (FORWARDED_BY, self._name)]

    async def _refused(self, context: Any, owner: Owner, err: grpc.aio.AioRpcError) -> None:
        """Answer with the owner's status; an owner that cannot be reached says so, naming it."""
        trailing = tuple(err.trailing_metadata() or ())
        if err.code() == grpc.StatusCode.UNAVAILABLE and not trailing:
            self._forwarded.labels("grpc", "unreachable").inc()
            raise Unavailable(
                f"the owner {owner.name} at {owner.grpc_address} cannot be reached from replica "
                f"{self._name} ({err.details()}); retry in a few seconds (another replica takes over "
                "within seconds when an owner is gone)"
            )
        self._forwarded.labels("grpc", "refused").inc()
        await context.abort(err.code(), err.details() or "", trailing_metadata=trailing)

    async def unary(self, method: str, owner_of: Callable[[], Owner], request: bytes, context: Any) -> bytes:
        """Forward one unary call to ``owner_of()`` (read after the loop check) and return its answer."""
        owner, channel, metadata = self._target(context, owner_of)
        call = channel.unary_unary(method, None, None)(
            request,
            metadata=metadata,
            timeout=context.time_remaining(),
        )
        try:
            response: bytes = await call
            trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as err:
            await self._refused(context, owner, err)
            raise  # unreachable: _refused raises or aborts
        context.set_trailing_metadata(tuple(trailing or ()))
        self._forwarded.labels("grpc", "ok").inc()
        return response

    async def stream(
        self, method: str, owner_of: Callable[[], Owner], request: bytes, context: Any
    ) -> AsyncIterator[bytes]:
        """Forward one server-streaming call; yields the owner's messages as they come."""
        owner, channel, metadata = self._target(context, owner_of)
        call = channel.unary_stream(method, None, None)(
            request,
            metadata=metadata,
            timeout=context.time_remaining(),
        )
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as err:
            await self._refused(context, owner, err)


class GrpcChannels:
    """One channel per owner address, TLS like this replica's own port when it serves TLS.

    With TLS, the owner's certificate is checked against this replica's own certificate (the replicas
    of a store share one, naming every host they advertise) and ``tls_client_ca``; with mutual TLS,
    this replica presents its own.
    """

    def __init__(
        self,
        max_message_bytes: int,
        tls: tuple[bytes, bytes, bytes, bool] | None = None,
    ) -> None:
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def __call__(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address`` (made on first use)."""
        channel = self._channels.get(address)
        if channel is None:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            else:
                trusted, cert, key, mutual = self._tls
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=trusted,
                    private_key=key if mutual else None,
                    certificate_chain=cert if mutual else None,
                )
                channel = grpc.aio.secure_channel(address, credentials, options=self._options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()


def http_app(
    route: OwnerRoute,
    metrics: ReplicaMetrics,
    client: httpx.AsyncClient,
    scheme: str,
    authorizer: Authorizer,
    reads: ReplicaReads,
    name: str,
    max_message_bytes: int,
) -> FastAPI:
    """The HTTP face of a replica: probes, ``/metrics`` and reads here, every other request at the owner.

    The reads of ``LOCAL_CALLS`` are served by the owner's own routes over ``reads``.
    """
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_message_bytes)
    # Outermost, as at the owner: a request id, an access line and timing for every request.
    app.add_middleware(RequestMiddleware, latency=metrics.http_request_duration)
    install_handlers(app)
    guard = Guard(authorizer, reads.checkpoint_of, metrics_auth=False)
    service = cast(CoordinatorService, reads)
    for resource in (checkpoints, status, admin, failures, totals):
        resource.add_routes(app, service, guard)
    # Only the routes of the reads answered here: the others fall through to ``forward`` below.
    app.router.routes[:] = [
        r
        for r in app.router.routes
        if isinstance(r, APIRoute)
        and (op := declared_operation(r)) is not None
        and op.operation in LOCAL_CALLS
    ]

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_request: Request) -> Response:
        owner = route.owner
        if route.problem is not None or owner is None or not owner.http_address:
            problem = route.problem or "the store's owner has not said where to reach it"
            return _error(503, ErrorCode.UNAVAILABLE, f"not ready: {problem}")
        return JSONResponse({"status": "ready", "role": "replica", "owner": owner.name})

    async def prometheus(_request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def forward(request: Request) -> Response:
        return await relay_http(request, route.current, client, scheme, name, metrics.forwarded)

    async def unknown_yet(request: Request, _exc: Exception) -> Response:
        return await forward(request)

    app.add_exception_handler(ForwardToOwner, unknown_yet)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app.router.routes[:0] = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    app.router.routes.append(Route("/{path:path}", forward, methods=methods))
    return app


async def relay_http(
    request: Request,
    owner_of: Callable[[], Owner],
    client: httpx.AsyncClient,
    scheme: str,
    name: str,
    forwarded: Counter,
    body: bytes | None = None,
) -> Response:
    """Send an HTTP request on as it came to ``owner_of()`` and stream its answer back.

    ``body``: the request's body when the caller has read it already (to route it).
    """
    came_from = request.headers.get(FORWARDED_BY)
    if came_from is not None:
        return _error(503, ErrorCode.UNAVAILABLE, _loop(came_from, name))
    try:
        owner = owner_of()
    except Unavailable as exc:
        return _error(503, ErrorCode.UNAVAILABLE, exc.message)
    if not owner.http_address:
        return _error(503, ErrorCode.UNAVAILABLE, f"the owner {owner.name} has no HTTP address")
    url = httpx.URL(f"{scheme}://{owner.http_address}{request.url.path}", query=request.url.query.encode())
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _SET_ANEW]
    headers += [(FORWARDED_BY, name), (REQUEST_ID_KEY, logs.request_id.get())]
    content = body if body is not None else await request.body()
    outgoing = client.build_request(request.method, url, headers=headers, content=content)
    try:
        answer = await client.send(outgoing, stream=True)
    except httpx.TransportError as exc:
        forwarded.labels("http", "unreachable").inc()
        return _error(
            503,
            ErrorCode.UNAVAILABLE,
            f"the owner {owner.name} at {owner.http_address} cannot be reached from replica {name} "
            f"({exc}); retry in a few seconds (another replica takes over within seconds when an "
            "owner is gone)",
        )
    forwarded.labels("http", "ok" if answer.status_code < 400 else "refused").inc()
    kept = {k: v for k, v in answer.headers.items() if k.lower() not in _SET_ANEW}
    return StreamingResponse(
        answer.aiter_raw(), status_code=answer.status_code, headers=kept, background=_closing(answer)
    )


def _loop(came_from: str, here: str) -> str:
    return (
        f"replica {came_from} forwarded this call to replica {here}, which does not own the store either; "
        "each coordinator of a store needs its own TALLY_REPLICA_NAME and a TALLY_ADVERTISE_HOST that "
        "reaches it — retry once the store's owner is known again"
    )


def _closing(answer: httpx.Response) -> Any:
    from starlette.background import BackgroundTask

    return BackgroundTask(answer.aclose)


def _error(status: int, code: ErrorCode, message: str) -> Response:
    return error_response(status, code, message)


def grpc_server(
    forwarder: GrpcForwarder, listen: str, max_message_bytes: int, credentials: grpc.ServerCredentials | None
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """The replica's gRPC server (not started), its bound port and its health servicer."""
    server = grpc.aio.server(
        # As at the owner: request ids, access lines and timing outermost (forwarded calls too).
        interceptors=[RequestInterceptor(forwarder.metrics.grpc_request_duration), ErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((forwarder,))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server, add_grpc_port(server, listen, credentials), health


def list_replicas(board: ReplicaBoard) -> ReplicasView:
    """The store's replicas and epoch, as the database says now (blocking).

    Raises:
        StoreUnavailable: the database cannot be read now (UNAVAILABLE: retry).
    """
    try:
        owner, replicas = board.snapshot()
    except TRANSIENT as exc:
        raise read_error(board.url, exc, "the store's replicas") from None
    views = [
        ReplicaView(r.name, r.grpc_address, r.http_address, r.owner, r.started_at, r.silent_s, r.shards)
        for r in replicas
    ]
    return ReplicasView(views, owner.epoch if owner is not None else 0, answered_by=board.name)


def poll_owner(board: ReplicaBoard, route: OwnerRoute) -> None:
    """One poll of a replica: renew its row, read the owner (errors recorded, never raised)."""
    try:
        board.announce()
        route.update(board.owner())
    except ReplicaNameInUse as exc:
        route.update(None, str(exc))
    except TRANSIENT as exc:
        route.update(None, f"the store's database cannot be reached ({exc.__class__.__name__})")
    except Exception as exc:  # a bug: say so, keep polling
        log.exception("reading the store's owner failed")
        route.update(None, f"reading the store's owner failed ({exc!r})")


async def mirror_health(route: OwnerRoute, health: HealthServicer, halt: threading.Event) -> None:
    """GRPC health says SERVING exactly while the replica has a live owner to forward to."""
    serving: bool | None = None
    while not halt.is_set():
        ready = route.problem is None
        if ready != serving:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await health.set("", status)
            await health.set(SERVICE_NAME, status)
            serving = ready
        await asyncio.sleep(0.25)


__all__ = [
    "LOCAL_CALLS",
    "CompletedReader",
    "ForwardToOwner",
    "ReplicaReads",
    "GrpcChannels",
    "GrpcForwarder",
    "OwnerRoute",
    "list_replicas",
    "ReplicaMetrics",
    "grpc_server",
    "http_app",
    "mirror_health",
    "poll_owner",
]
