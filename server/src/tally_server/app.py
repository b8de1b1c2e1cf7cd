"""Composition root: stores → service → gRPC + HTTP, all in one asyncio event loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import ipaddress
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import grpc
import httpx
import sqlalchemy as sa
import uvicorn
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from sqlalchemy.engine import Connection

from tally_server import malloc, replica
from tally_server.auth import Authorizer, load_tokens
from tally_server.domain import idmap
from tally_server.domain.ports import CompletionStore, JointCommit, Journal
from tally_server.grpc_api.server import SERVICE_NAME, build_server, server_credentials
from tally_server.http_api.app import create_app
from tally_server.listen import bind_http
from tally_server.loop_load import new_event_loop
from tally_server.metrics import Metrics
from tally_server.replica_cache import CompletedCache
from tally_server.service import CoordinatorService
from tally_server.service.bridge import ServiceBridge
from tally_server.settings import Settings, split_listen
from tally_server.store.datadir_lock import DataDirLock
from tally_server.store.journal import NoJournal
from tally_server.store.journal_log import LogJournal
from tally_server.store.lmdb_files import LmdbCompletionStore
from tally_server.store.pg_completions import PgCompletionStore
from tally_server.store.pg_journal import PgJournal
from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import (
    RENEW_EVERY_S,
    TAKE_OVER_AFTER_S,
    TRANSIENT,
    StoreInUse,
    StoreLock,
    StoreUnreachable,
    cause,
    display,
    store_url,
)
from tally_server.store.registry import RegistryUnavailable, SqlRegistry
from tally_server.store.replicas import ReplicaBoard, ReplicaNameInUse, check_name_free
from tally_server.store.shards import Fence, ShardFence, prepare_layout

log = logging.getLogger(__name__)
# On the PostgreSQL store, how long the event loop may keep the GIL from a thread that wants it back
# (Python's default is 5 ms). A group commit's thread waits on the database several times per
# commit and needs the GIL after each wait; with the default it often waited for the loop's
# 5 ms slice each time, in series with the commit (measured: +8-20 % durable completions/s with
# 1 ms, the server's CPU per completion no higher). The LMDB store's commits, a few waits on the
# disk, gained nothing from it, so it stays at the default there.
PG_SWITCH_INTERVAL_S = 0.001


def build_service(
    settings: Settings,
    loop_idle: Sequence[Callable[[], float]] = (),
    fence: Fence | Callable[[Connection], None] | None = None,
    owns: Callable[[str], bool] | None = None,
) -> CoordinatorService:
    """Build the coordinator service the settings describe, on its stores (creating the data directory).

    ``fence`` (the store lock, or a ``ShardFence`` of the shards held): every write to a PostgreSQL
    store checks the epochs of the fence's shards first. ``owns``: the checkpoints (by name) this
    coordinator owns, where several share the store (see ``CoordinatorService``); None: all of them.
    """
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    completions: CompletionStore
    journal: Journal = NoJournal()
    joint_commit: JointCommit | None = None
    if settings.store is None:  # the default: NeMo Curator's LMDB files in the data directory
        completions = LmdbCompletionStore(settings.data_dir)
        if settings.journal:
            journal = LogJournal(settings.data_dir)
    else:
        completions = pg_completions = PgCompletionStore(settings.store, fence)
        try:
            if settings.journal:
                journal = pg_journal = PgJournal(settings.store, fence)
                # One database: a group's journal entries and completions in one transaction.
                joint_commit = functools.partial(pg_completions.commit_group, pg_journal)
        except BaseException:
            completions.close()
            raise
    try:
        registry = SqlRegistry(settings.resolved_registry_url(), fence=_registry_fence(settings, fence))
    except RegistryUnavailable as exc:  # at start: one line from tally serve, not a traceback
        completions.close()
        journal.close()
        raise OSError(
            f"cannot use the registry database {_hide_password(settings.resolved_registry_url())}: "
            f"{exc.details.get('cause', exc.message)}; check the URL (--registry-url / "
            "TALLY_REGISTRY_URL), that the database is running and reachable from here and that the "
            "user may connect and create tables, then start again"
        ) from None
    except BaseException:
        completions.close()
        journal.close()
        raise
    return CoordinatorService(
        completions=completions,
        registry=registry,
        journal=journal,
        journal_snapshot_deltas=settings.journal_snapshot_deltas,
        limits=settings.limits,
        settle_ms=settings.settle_ms,
        lease_ttl_s=settings.lease_ttl_s,
        progress_interval_s=settings.progress_interval_s,
        memory_budget_bytes=settings.checkpoint_memory_mb << 20,
        loop_idle=loop_idle,
        joint_commit=joint_commit,
        owns=owns,
        # Ops of a shard not held fail before their commit, not with the others' ops in it.
        not_held=fence.refusal if isinstance(fence, ShardFence) else None,
    )


def _registry_fence(settings: Settings, fence: Fence | Callable[[Connection], None] | None) -> Fence | None:
    """The fence of the registry's writes: the store's, if the registry is in the store's database.

    Every registry write about checkpoints then runs it in its own transaction
    (``store.registry_fence``). A registry in another database (``--registry-url``) cannot run it
    in the same transaction: its writes are not fenced, and this says so at start.
    """
    if not isinstance(fence, Fence) or settings.store is None:
        return None
    if settings.registry_url is None or _same_database(settings.registry_url, settings.store):
        return fence
    log.warning(
        "the registry %s is not in the store's database, so its writes (writer rows, events, claims, "
        "cursors, failed attempts) are not fenced by the store's epochs: a coordinator that lost a "
        "shard may still write them; leave --registry-url out to keep the registry in the store",
        _hide_password(settings.registry_url),
    )
    return None


def _same_database(registry: str, store: str) -> bool:
    """Whether two database URLs name one PostgreSQL database (host, port and name; any driver)."""
    a, b = sa.make_url(registry), sa.make_url(store)
    if a.get_backend_name() != "postgresql" or b.get_backend_name() != "postgresql":
        return False
    return (a.host or "", a.port or 5432, a.database) == (b.host or "", b.port or 5432, b.database)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: ``serve`` owns SIGTERM/SIGINT for both transports."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _hide_password(url: str) -> str:
    return sa.make_url(url).render_as_string(hide_password=True)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tls(settings: Settings) -> tuple[grpc.ServerCredentials | None, dict[str, Any]]:
    """GRPC credentials and uvicorn's ssl options from the certificate files (none without TLS).

    The files are loaded once here with Python's ssl module, so a wrong path, a key that does not
    match the certificate or a malformed PEM stops ``tally serve`` at once with the reason.
    """
    if settings.tls_cert is None or settings.tls_key is None:
        return None, {}
    cert, key, client_ca = settings.tls_cert, settings.tls_key, settings.tls_client_ca
    try:
        check = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        check.load_cert_chain(cert, key)
        if client_ca is not None:
            check.load_verify_locations(client_ca)
    except (OSError, ssl.SSLError) as exc:
        files = f"tls_cert={cert}, tls_key={key}" + (f", tls_client_ca={client_ca}" if client_ca else "")
        raise OSError(
            f"cannot serve TLS with {files}: {exc}; give PEM files, the key matching the certificate"
        ) from None
    options: dict[str, Any] = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    if client_ca is not None:
        options.update(ssl_ca_certs=str(client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return server_credentials(cert, key, client_ca), options


def _peer_tls(settings: Settings) -> ssl.SSLContext | None:
    """How a replica checks the owner's HTTPS port (None without TLS).

    The owner's certificate is trusted if the system's CAs, the replicas' own certificate (they
    share one) or ``tls_client_ca`` vouch for it; under mutual TLS the replica presents its own.
    """
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.create_default_context()
    context.load_verify_locations(settings.tls_cert)
    if settings.tls_client_ca is not None:
        context.load_verify_locations(settings.tls_client_ca)
    # The shared certificate is trusted as itself, CA-issued or not (Python 3.13's default).
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if settings.tls_client_ca is not None:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    return context


def relay_tls(settings: Settings) -> tuple[bytes, bytes, bytes, bool] | None:
    """What this coordinator needs to call another one of its store over TLS (its own certificate)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    trusted = settings.tls_cert.read_bytes()
    if settings.tls_client_ca is not None:
        trusted += b"\n" + settings.tls_client_ca.read_bytes()
    return (
        trusted,
        settings.tls_cert.read_bytes(),
        settings.tls_key.read_bytes(),
        settings.tls_client_ca is not None,
    )


def _loopback(listen: str) -> bool:
    """Whether a listen address is reachable from this machine only (0.0.0.0 and :: are not)."""
    host, _ = split_listen(listen)
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def _warn_exposed(settings: Settings, authorizer: Authorizer) -> None:
    exposed = [listen for listen in (settings.grpc_listen, settings.http_listen) if not _loopback(listen)]
    if exposed and not authorizer.enabled:
        log.warning(
            "authentication is off (no tokens configured) and tally serve listens beyond this machine "
            "on %s: anyone who reaches it may read, write and reset every checkpoint; set "
            "TALLY_TOKENS or TALLY_TOKENS_FILE (docs/deploy.md, 'Access: tokens and TLS'), or listen "
            "on 127.0.0.1",
            " and ".join(exposed),
        )
    for listen in exposed:
        if authorizer.enabled and not settings.tls:
            log.warning(
                "bearer tokens travel in plain text on %s: serve TLS (--tls-cert/--tls-key) or put a "
                "TLS-terminating proxy in front",
                listen,
            )
    if settings.metrics_auth and not authorizer.enabled:
        log.warning("metrics_auth is on but no tokens are configured, so /metrics stays open")


async def _mirror_readiness(service: CoordinatorService, health: HealthServicer) -> None:
    """GRPC health says SERVING exactly while /readyz says ready (checked every half second)."""
    serving: bool | None = None
    while True:
        ready = service.ready
        if ready != serving:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await health.set("", status)
            await health.set(SERVICE_NAME, status)
            if serving is not None:
                log.warning("readiness: %s", "ready" if ready else "; ".join(service.problems()))
            serving = ready
        await asyncio.sleep(0.5)


# Past this long without confirming the store is ours, reads of completions are refused: a standby
# takes over after TAKE_OVER_AFTER_S without our stamp (on the database's clock).
UNCONFIRMED_AFTER_S = TAKE_OVER_AFTER_S - 1.5


class _StoreKeeper:
    """Checks the store's lock every ``RENEW_EVERY_S`` (which shows standbys we are alive).

    On a thread of its own, not the event loop: a loop busy for a few seconds must not look like a
    paused coordinator to a standby. Stops the server if another coordinator took the store.
    """

    def __init__(
        self, lock: StoreLock, board: ReplicaBoard, loop: asyncio.AbstractEventLoop, stop: asyncio.Event
    ) -> None:
        self._lock, self._board, self._loop, self._stop = lock, board, loop, stop
        self.confirmed_at = time.monotonic()  # the last check that found the store ours
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tally-store-lock", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._halt.wait(RENEW_EVERY_S):
            try:
                self._lock.check()
                self.confirmed_at = time.monotonic()
                self._board.announce()  # where the replicas forward writers' calls to
            except StoreInUse as exc:
                log.error("this coordinator lost the store's lock: %s; stopping this one", exc)
                self._loop.call_soon_threadsafe(self._stop.set)
                return
            except StoreUnreachable as exc:
                log.warning("cannot take the store's lock again yet: %s", exc)
            except ReplicaNameInUse as exc:
                log.error("cannot renew this coordinator's row among the store's replicas: %s", exc)
            except TRANSIENT as exc:  # its connection cut mid-renewal (a restart): the next one renews
                log.warning("cannot renew this coordinator's row among the replicas yet: %s", cause(exc))
            except Exception:  # a bug: say so, keep checking (commits are fenced either way)
                log.exception("checking the store's lock failed")

    def close(self) -> None:
        self._halt.set()
        self._thread.join()


class _Confirming(Protocol):
    confirmed_at: float  # time.monotonic() of the last check that found the store (or shards) ours


async def _watch_store_contact(keeper: _Confirming, service: CoordinatorService) -> None:
    """Refuse reads of completions while the store's ownership has gone unconfirmed too long.

    A check may hang (a database host gone silent) while a standby counts ``TAKE_OVER_AFTER_S``
    from our last stamp and takes over: past ``UNCONFIRMED_AFTER_S`` without a check that found the
    store ours, this coordinator's completed sets may be stale (a read could say completed what the
    new one un-completed), so it stops answering for them until a check succeeds again.
    """
    while True:
        silent = time.monotonic() - keeper.confirmed_at
        service.store_contact(
            f"no contact with the store's database for {silent:.0f} s (a standby may have taken over)"
            if silent > UNCONFIRMED_AFTER_S
            else None
        )
        await asyncio.sleep(0.25)


# uvicorn's HTTP/1.1 parser, named: left to itself ("auto") uvicorn takes httptools wherever that
# happens to be installed, and httptools answers some malformed requests itself, in plain text
# (a path of 100 KB: "Invalid HTTP request received."), where h11 lets Tally answer in its JSON.
HTTP_PARSER = "h11"


def http_config(
    app: Any, settings: Settings, ssl_options: dict[str, Any], *, grace_s: int | None = None
) -> uvicorn.Config:
    """Uvicorn's configuration for a coordinator's HTTP app (no access log of its own, TLS as set).

    ``grace_s``: seconds open requests get at shutdown (default: the settings' shutdown grace).
    """
    return uvicorn.Config(
        app,
        http=HTTP_PARSER,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=grace_s if grace_s is not None else int(settings.shutdown_grace_s) or None,
        timeout_keep_alive=settings.http_keepalive_s,
        **ssl_options,
    )


class _HttpThread:
    """uvicorn on a thread and event loop of its own.

    HTTP requests (status reads from dashboards and scripts above all) then never take turns of
    the service's loop, where gRPC accepts one new call per turn: an HTTP read storm cannot hold
    up gRPC heartbeats. Calls into the service cross over through :class:`ServiceBridge`.
    """

    def __init__(self, server: _Uvicorn, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._sock = sock
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tally-http", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=lambda: self._loop) as runner:
            try:
                runner.run(self._server.serve(sockets=[self._sock]))
            except BaseException as exc:
                self._error = exc

    async def start(self) -> None:
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            await asyncio.sleep(0.01)
        if not self._server.started:
            await asyncio.to_thread(self._thread.join)
            raise RuntimeError(f"the HTTP server did not start: {self._error!r}") from self._error

    async def stop(self) -> None:
        self._server.should_exit = True
        await asyncio.to_thread(self._thread.join)


def run(settings: Settings) -> None:
    """Serve on an event loop whose load is measured (lease time slows while it is saturated)."""
    malloc.fix_mmap_threshold()
    idmap.use(settings.ledger_core)
    if settings.store is not None:
        sys.setswitchinterval(PG_SWITCH_INTERVAL_S)
    loop, selector = new_event_loop()
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.run(serve(settings, loop_idle=lambda: selector.idle_s))


async def serve(settings: Settings, loop_idle: Callable[[], float] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then stop accepting, flush every completion to disk and close the stores.

    Raises:
        DataDirInUse: another coordinator serves the same data directory (nothing was opened).
    """
    # Before any store opens: a second coordinator on this directory stops here. Held until the
    # process ends (the kernel releases it even after kill -9).
    credentials, ssl_options = _tls(settings)
    try:
        authorizer = Authorizer(load_tokens(settings.tokens, settings.tokens_file))
    except ValueError as exc:  # a malformed tokens file (TALLY_TOKENS is checked by Settings)
        raise OSError(f"cannot use the tokens file {settings.tokens_file}: {exc}") from None
    _warn_exposed(settings, authorizer)
    datadir_lock = DataDirLock(settings.data_dir)
    datadir_lock.acquire()
    # Likewise one coordinator serves a PostgreSQL store at a time; a standby waits for it to go
    # (listening on no port meanwhile, so clients and load balancers pass it by).
    store_lock = None
    if settings.store is not None:
        store_lock = StoreLock(store_url(settings.store), settings.resolved_replica_name())
        # Two live coordinators under one name would forward to each other: refused here, in one line.
        await asyncio.to_thread(check_name_free, store_lock.url, store_lock.holder)
        shards = await asyncio.to_thread(prepare_layout, store_lock.url, settings.store_shards)
        if shards > 1:
            if settings.standby:
                raise OSError(
                    f"the store {display(store_lock.url)} has {shards} shards: every coordinator on it "
                    "serves and owns some of them, none waits as a standby; start without --standby"
                )
            from tally_server.serve_shards import serve_shards

            stopping_ = threading.Event()
            try:
                await serve_shards(
                    settings, shards, authorizer, credentials, ssl_options, stopping_, loop_idle
                )
            finally:
                datadir_lock.release()
            return
    loop = asyncio.get_running_loop()
    # From here on SIGTERM/SIGINT are kept, not lost: a stop asked while a standby or a replica takes
    # the store over (after its wait has ended, before the coordinator's own handlers are in place)
    # shuts the coordinator down gracefully as soon as it is up.
    stopping = threading.Event()
    if store_lock is not None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
    if store_lock is not None and settings.standby:
        # The database was reached checking the name: an outage from here on is waited out.
        if not await asyncio.to_thread(store_lock.wait_for, stopping, reached=True):
            log.info("standby stopped before taking over")
            datadir_lock.release()
            return
        log.info("taking over store %s (epoch %s)", display(store_lock.url), store_lock.epoch)
    elif store_lock is not None:
        try:
            store_lock.acquire()
            log.info("owning store %s (epoch %s)", display(store_lock.url), store_lock.epoch)
        except StoreInUse as exc:
            log.info("%s: serving as a replica of it", exc.holder_text)
            bound = await _serve_as_replica(
                settings, store_lock, authorizer, credentials, ssl_options, stopping
            )
            if bound is None:
                log.info("replica stopped before taking the store over")
                datadir_lock.release()
                return
            settings = bound
            log.info("taking over store %s (epoch %s)", display(store_lock.url), store_lock.epoch)
    http_sock = bind_http(settings.http_listen)
    http_loop, http_selector = new_event_loop()
    try:
        idle = [lambda: http_selector.idle_s] + ([loop_idle] if loop_idle else [])
        service = build_service(settings, idle, store_lock)
        # The HTTP transport runs on its own loop and sees the service through the bridge.
        bridged = cast(CoordinatorService, ServiceBridge(service, loop))
        metrics = Metrics(bridged, settings.data_dir)  # one registry, fed by both transports and the store
        if store_lock is not None:
            metrics.watch_store_lock(store_lock)
        await service.start()
        grpc_server, grpc_port, health = build_server(
            service,
            settings.grpc_listen,
            settings.max_message_bytes,
            metrics=metrics,
            authorizer=authorizer,
            credentials=credentials,
        )
        config = http_config(
            create_app(bridged, settings, metrics=metrics, authorizer=authorizer), settings, ssl_options
        )
    except BaseException:
        # Until the HTTP thread owns them: a start that fails (the registry cannot be reached, a
        # port is taken, ...) closes them, so the exit prints one line, not an event loop's
        # teardown errors.
        http_loop.close()
        http_sock.close()
        raise
    http = _HttpThread(_Uvicorn(config), http_sock, http_loop)

    grpc_host, _ = split_listen(settings.grpc_listen)
    http_host, http_port = http_sock.getsockname()[:2]
    board = None
    status_board = None
    if store_lock is not None:
        board = ReplicaBoard(
            store_lock.url,
            store_lock.holder,
            settings.advertised(settings.grpc_listen, grpc_port),
            settings.advertised(settings.http_listen, http_port),
        )
        await asyncio.to_thread(board.announce)
        status_board = await asyncio.to_thread(StatusBoard, store_lock.url, store_lock)
        service.serve_replicas(
            store_lock.holder, functools.partial(replica.list_replicas, board), status_board.publish
        )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stopping.is_set():
        log.info("a stop was asked while taking the store over: shutting down at once")
        stop.set()

    await grpc_server.start()
    health_task = loop.create_task(_mirror_readiness(service, health), name="tally-health")
    keeper = (
        _StoreKeeper(store_lock, board, loop, stop) if store_lock is not None and board is not None else None
    )
    contact_task = None
    if keeper is not None:
        keeper.start()
        contact_task = loop.create_task(_watch_store_contact(keeper, service), name="tally-store-contact")
    await http.start()
    # What start-up made (modules, protobuf descriptors, the registry's engine: ~150,000 objects)
    # lives as long as the process: out of the collector's sight, a full collection no longer walks
    # it all (tens of milliseconds on the loop, in the middle of some call).
    gc.freeze()
    # Tests and scripts read these two lines to find the ports when started with port 0.
    print(f"grpc listening on {_address(grpc_host, grpc_port)}", flush=True)
    print(f"http listening on {_address(http_host, http_port)}", flush=True)
    log.info(
        "tally serving%s; data in %s, completions in %s, registry %s; %s counting core",
        " over TLS" + (" with client certificates" if settings.tls_client_ca else "") if settings.tls else "",
        settings.data_dir,
        display(store_url(settings.store)) if settings.store else "LMDB files in the data directory",
        _hide_password(settings.resolved_registry_url()),
        idmap.current().name,
    )

    await stop.wait()
    log.info("shutting down: refusing new work, flushing completions")
    service.stop_accepting()
    health_task.cancel()
    await health.enter_graceful_shutdown()
    await asyncio.gather(grpc_server.stop(settings.shutdown_grace_s), http.stop())
    # The store stays ours (renewed, reads checked) until the last completion is flushed: a drain
    # longer than a replica's wait must not let one take over under the final flush.
    await service.shutdown()
    if contact_task is not None:
        contact_task.cancel()
    if keeper is not None:
        keeper.close()
    if board is not None:
        await asyncio.to_thread(board.leave)
        board.close()
    if status_board is not None:
        status_board.close()
    if store_lock is not None:
        store_lock.release()
    datadir_lock.release()
    log.info("shutdown complete")


async def _serve_as_replica(
    settings: Settings,
    lock: StoreLock,
    authorizer: Authorizer,
    credentials: grpc.ServerCredentials | None,
    ssl_options: dict[str, Any],
    stopping: threading.Event,
) -> Settings | None:
    """Serve as a replica of the store (``tally_server.replica``) until its lock is ours.

    Returns the settings with the ports the replica bound (the coordinator serves on the same ones),
    or None if ``stopping`` (SIGTERM/SIGINT, the caller's handlers) was set first.
    """
    loop = asyncio.get_running_loop()
    http_sock = bind_http(settings.http_listen)
    route = replica.OwnerRoute()
    metrics = replica.ReplicaMetrics(lock.holder, route)
    reader = replica.CompletedReader(lock.url, CompletedCache(settings.replica_cache_ids), metrics)
    channels = replica.GrpcChannels(settings.max_message_bytes, relay_tls(settings))
    board = ReplicaBoard(lock.url, lock.holder, "", "")  # its addresses once the ports are bound
    listing = functools.partial(replica.list_replicas, board)
    statuses = await asyncio.to_thread(StatusBoard, lock.url)
    registry = await asyncio.to_thread(SqlRegistry, settings.resolved_registry_url())
    reads = replica.ReplicaReads(settings.limits, reader, statuses, registry, listing, metrics)
    forwarder = replica.GrpcForwarder(route, reads, authorizer, metrics, channels, lock.holder)
    server, grpc_port, health = replica.grpc_server(
        forwarder, settings.grpc_listen, settings.max_message_bytes, credentials
    )
    grpc_host, _ = split_listen(settings.grpc_listen)
    http_host, http_port = http_sock.getsockname()[:2]
    board.grpc_address = settings.advertised(settings.grpc_listen, grpc_port)
    board.http_address = settings.advertised(settings.http_listen, http_port)
    bound = settings.model_copy(
        update={"grpc_listen": _address(grpc_host, grpc_port), "http_listen": _address(http_host, http_port)}
    )
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        verify=_peer_tls(settings) or True,
    )
    app = replica.http_app(
        route,
        metrics,
        client,
        "https" if settings.tls else "http",
        authorizer,
        reads,
        lock.holder,
        settings.max_message_bytes,
    )
    config = http_config(app, settings, ssl_options, grace_s=1)
    http = _Uvicorn(config)
    halt = threading.Event()
    await asyncio.to_thread(replica.poll_owner, board, route)
    await server.start()
    http_task = loop.create_task(http.serve(sockets=[http_sock]), name="tally-replica-http")
    health_task = loop.create_task(replica.mirror_health(route, health, halt), name="tally-replica-health")
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    print(f"grpc listening on {_address(grpc_host, grpc_port)}", flush=True)
    print(f"http listening on {_address(http_host, http_port)}", flush=True)
    owner = route.owner
    log.info(
        "replica %s of store %s: answering reads, forwarding the rest to the owner %s",
        lock.holder,
        display(lock.url),
        f"{owner.name} at {owner.grpc_address}" if owner is not None else "(not known yet)",
    )
    try:
        took = await asyncio.to_thread(
            lock.wait_for, stopping, lambda: replica.poll_owner(board, route), "replica", reached=True
        )
    finally:
        halt.set()
        health_task.cancel()
        http.should_exit = True
        await server.stop(1.0)
        await http_task
        await channels.close()
        await client.aclose()
        reader.close()
        statuses.close()
        registry.close()
    if not took:
        await asyncio.to_thread(board.leave)
    board.close()
    return bound if took else None
