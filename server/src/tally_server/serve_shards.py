"""``tally serve`` on a PostgreSQL store of several shards (``sharding``).

Every coordinator on such a store serves: it holds the shards rendezvous hashing gives it among the
live replicas (``sharding.desired_shards``), runs the coordinator service for their checkpoints
alone (its writes fenced by those shards' epochs) and routes every call of another shard to the
shard's holder. A :class:`ShardKeeper` thread renews the shard leases every ``RENEW_EVERY_S``,
announces the coordinator in ``store_replicas``, reads who holds what, takes the shards that are its
own and free (a holder gone: silent for ``SHARD_HOLDER_GONE_AFTER_S``; a holder still holding its lease
silent past ``TAKE_OVER_AFTER_S`` has its session ended) and says
when the set should change: a shard taken or lost, or one to hand over to a replica that joined.

A shard only gained (taken from a coordinator that died or stopped, or found free) is adopted
into the running service (:func:`_adopt_gained`): its lock fences the service's writes from then
on, the service restores its checkpoints and journaled writers beside those it serves
(``CoordinatorService.adopt``), and only then are its calls served here; the writers of the
shards held all along notice nothing. A shard handed over (a replica joined that it belongs to
now) is given up in place, in the reverse order (:func:`_hand_over`): its calls are refused here
as moving, the service lets go of its checkpoints (``CoordinatorService.release``: their calls at
work finish, their writers' journals are made durable, and they leave memory without their writers
being closed or marked lost), and only then does its lock leave the fence and is released, for the
new holder to take and restore from the journal; a commit still carrying one of its checkpoints
after that is refused by the fence (``ShardFence``). Here too the writers of the shards kept
notice nothing; those of the moved shard re-attach at its new holder, from the journal.

A shard lost (its lease taken while this coordinator was paused or cut off) is dropped in place
(:func:`_drop_lost`): its epoch moved on, so nothing of it can be written here and its new holder
restored it from the store as after a crash; its calls are refused here, its lock leaves the fence
at once (the shards kept committed all along: a commit is fenced by the shards it carries) and the
service forgets its checkpoints without flushing
(``CoordinatorService.lose``). A loss, a hand-over or an adoption that fails (the database out of
reach, calls that would not finish) restarts the service instead: it stops gracefully (every
acknowledged completion flushed, the writers' journals kept), lets go of the shards it hands over,
and starts a new service on the same ports for the new set; the writers of the shards that stay
then see their calls refused as UNAVAILABLE for that second or two and re-attach as after any
restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, cast

import grpc
import httpx

from tally_server import replica
from tally_server.auth import Authorizer
from tally_server.domain.words import count
from tally_server.errors import TallyServerError
from tally_server.grpc_api.server import build_server
from tally_server.http_api.app import create_app
from tally_server.listen import bind_http
from tally_server.loop_load import new_event_loop
from tally_server.metrics import Metrics
from tally_server.service import CoordinatorService
from tally_server.service.bridge import ServiceBridge
from tally_server.settings import Settings, split_listen
from tally_server.sharding import HttpShardRouter, ShardMap, ShardRouter, desired_shards, handle_tag
from tally_server.store.pg_status import StatusBoard
from tally_server.store.postgres import (
    RENEW_EVERY_S,
    SHARD_HOLDER_GONE_AFTER_S,
    TRANSIENT,
    StoreInUse,
    StoreLock,
    StoreUnreachable,
    cause,
    display,
    store_url,
)
from tally_server.store.replicas import ReplicaBoard, ReplicaNameInUse
from tally_server.store.shards import ShardFence, shard_of

log = logging.getLogger(__name__)


class ShardKeeper:
    """Renews this coordinator's shard leases and decides which shards it should hold (a thread)."""

    def __init__(self, lock_of: Callable[[int], StoreLock], board: ReplicaBoard, shard_map: ShardMap) -> None:
        self._lock_of = lock_of
        self._board = board
        self._map = shard_map
        self.held: dict[int, StoreLock] = {}
        self.surplus: frozenset[int] = frozenset()  # held shards another live replica should hold
        self.confirmed_at = time.monotonic()  # the last round that renewed every held lease
        self.draining = False  # stopping: renew what is held, take nothing more
        self._mutex = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_change: Callable[[], object] = lambda: None

    def start(self, on_change: Callable[[], object]) -> None:
        """Run a round every ``RENEW_EVERY_S`` on a thread; ``on_change`` when the set should change."""
        self._on_change = on_change
        self._thread = threading.Thread(target=self._run, name="tally-shard-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._halt.wait(RENEW_EVERY_S):
            try:
                if self.round():
                    self._on_change()
            except Exception:  # a bug: say so, keep renewing (commits are fenced either way)
                log.exception("a round of the shard keeper failed")

    def round(self) -> bool:
        """Renew, announce, read the holders, take free shards of ours. True: the set should change."""
        with self._mutex:
            changed = False
            renewed = True
            for shard, lock in sorted(self.held.items()):
                try:
                    lock.check()
                except StoreInUse as exc:
                    log.error("lost shard %s of the store to another coordinator: %s", shard, exc)
                    del self.held[shard]
                    lock.release()
                    changed = True
                except StoreUnreachable as exc:
                    log.warning("cannot renew the lease of shard %s yet: %s", shard, exc)
                    renewed = False
            if renewed:
                self.confirmed_at = time.monotonic()
            try:
                self._board.announce()
                owners, replicas = self._board.holders()
            except (ReplicaNameInUse, *TRANSIENT) as exc:
                log.warning("cannot read the store's replicas yet: %s", cause(exc))
                return changed
            self._map.update(owners)
            me = self._map.me
            gone = SHARD_HOLDER_GONE_AFTER_S
            live = [r.name for r in replicas if r.silent_s < gone and r.grpc_address and r.name != me]
            desired = desired_shards(self._map.shards, live, me)
            for shard in sorted(desired - self.held.keys() if not self.draining else ()):
                holder = owners.get(shard)
                if holder is not None and holder.silent_s < gone and holder.name != me:
                    continue  # it hands the shard over once it sees this coordinator live
                lock = self._lock_of(shard)
                try:
                    if not lock.take():
                        continue
                except StoreUnreachable as exc:
                    log.warning("cannot take shard %s yet: %s", shard, exc)
                    continue
                log.info("took shard %s of the store (epoch %s)", shard, lock.epoch)
                self.held[shard] = lock
                changed = True
            surplus = frozenset(self.held.keys() - desired)
            if surplus and surplus != self.surplus:
                log.info(
                    "handing shard(s) %s over to the replicas they belong to now",
                    ", ".join(map(str, sorted(surplus))),
                )
            self.surplus = surplus
            return changed or bool(surplus)

    def hand_over(self, shards: Collection[int] | None = None) -> None:
        """Let go of the surplus shards (after the service that owned them stopped and flushed).

        ``shards``: of these alone (those the running service gave up); None: of every surplus one.
        """
        with self._mutex:
            going = self.surplus if shards is None else frozenset(shards)
            for shard in sorted(going & self.held.keys()):
                self.held.pop(shard).release()
                log.info("let go of shard %s", shard)
            self.surplus -= going

    def close(self) -> None:
        """Stop the rounds and let go of every shard."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        with self._mutex:
            for lock in self.held.values():
                lock.release()
            self.held.clear()


class _Stack:
    """One coordinator service for a fixed set of shards, with its gRPC and HTTP servers."""

    def __init__(
        self,
        service: CoordinatorService,
        grpc_server: grpc.aio.Server,
        http: Any,
        tasks: list[asyncio.Task[None]],
        status_board: StatusBoard,
        channels: replica.GrpcChannels,
        fence: ShardFence,
        held: dict[int, StoreLock],
    ) -> None:
        self.service, self.grpc_server, self.http = service, grpc_server, http
        self.tasks, self.status_board, self.channels = tasks, status_board, channels
        self.fence = fence  # its writes' fence (the status board's too: it publishes what it holds)
        self.held = dict(held)  # the shards its service owns, by lock

    async def stop(self, grace_s: float) -> None:
        """Refuse new work, stop the servers, flush every completion, close the stores."""
        from tally_server.app import _HttpThread

        self.service.stop_accepting()
        for task in self.tasks:
            task.cancel()
        http = cast(_HttpThread, self.http)
        await asyncio.gather(self.grpc_server.stop(grace_s), http.stop())
        await self.service.shutdown()
        await self.channels.close()
        self.status_board.close()


async def serve_shards(
    settings: Settings,
    shards: int,
    authorizer: Authorizer,
    credentials: grpc.ServerCredentials | None,
    ssl_options: dict[str, Any],
    stopping: threading.Event,
    loop_idle: Callable[[], float] | None,
) -> None:
    """Serve a store of ``shards`` shards until ``stopping`` (SIGTERM/SIGINT) is set."""
    from tally_server.app import _address

    url = store_url(settings.store or "")
    me = settings.resolved_replica_name()
    loop = asyncio.get_running_loop()
    shard_map = ShardMap(shards, me)
    board = ReplicaBoard(url, me, "", "")
    keeper = ShardKeeper(lambda shard: StoreLock(url, me, shard), board, shard_map)
    changed = asyncio.Event()
    stop = asyncio.Event()

    def stopped() -> None:
        stopping.set()
        keeper.draining = True
        stop.set()
        changed.set()

    # From here a stop reaches this loop at once (the caller's handlers only set ``stopping``).
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped)
    if stopping.is_set():
        stopped()
    await asyncio.to_thread(keeper.round)
    keeper.start(lambda: loop.call_soon_threadsafe(changed.set))
    bound = settings
    first = True

    def serving(held: dict[int, StoreLock]) -> None:
        log.info(
            "tally serving shard(s) %s of %s of store %s as %s",
            ", ".join(map(str, sorted(held))) or "(none yet)",
            shards,
            display(url),
            me,
        )

    try:
        while not stop.is_set():
            changed.clear()
            held = dict(keeper.held)
            shard_map.held = frozenset(held)
            try:
                stack, bound = await _start_stack(
                    bound,
                    shards,
                    shard_map,
                    held,
                    keeper,
                    board,
                    authorizer,
                    credentials,
                    ssl_options,
                    loop_idle,
                )
            except (OSError, TallyServerError, *TRANSIENT) as exc:
                if first:
                    raise  # at start: one line from tally serve, as on a store of one shard
                # A restart for a new set of shards that failed (the database out of reach just
                # then): the leases stay renewed by the keeper; try again shortly.
                log.warning(
                    "cannot start the service for shard(s) %s yet: %s; trying again", sorted(held), exc
                )
                shard_map.held = frozenset()
                await _wait_either(stop, RENEW_EVERY_S)
                continue
            if first:
                grpc_host, grpc_port = split_listen(bound.grpc_listen)
                http_host, http_port = split_listen(bound.http_listen)
                board.grpc_address = settings.advertised(settings.grpc_listen, grpc_port)
                board.http_address = settings.advertised(settings.http_listen, http_port)
                gc.freeze()
                print(f"grpc listening on {_address(grpc_host, grpc_port)}", flush=True)
                print(f"http listening on {_address(http_host, http_port)}", flush=True)
                first = False
            serving(held)
            while True:
                await changed.wait()
                changed.clear()
                if stop.is_set() or not await _change_in_place(stack, keeper, shard_map, shards):
                    break
                serving(stack.held)
            log.info(
                "the shards this coordinator holds change: restarting its service"
                if not stop.is_set()
                else "shutting down: refusing new work, flushing completions"
            )
            shard_map.held = frozenset()
            await stack.stop(settings.shutdown_grace_s)
            keeper.hand_over()
    finally:
        await asyncio.to_thread(keeper.close)
        await asyncio.to_thread(board.leave)
        board.close()
    log.info("shutdown complete")


async def _change_in_place(stack: _Stack, keeper: ShardKeeper, shard_map: ShardMap, shards: int) -> bool:
    """Drop the shards lost, give up the surplus ones, then adopt those gained, in ``stack``'s service.

    False: restart the service instead: a loss, a hand-over or an adoption that failed (the
    database out of reach, calls that would not finish).
    """
    held = dict(keeper.held)
    lost = frozenset(shard for shard, lock in stack.held.items() if held.get(shard) is not lock)
    if lost and not await _drop_lost(stack, shard_map, shards, lost):
        return False
    surplus = keeper.surplus & held.keys()
    if surplus and not await _hand_over(stack, keeper, shard_map, shards, surplus):
        return False
    return await _adopt_gained(stack, keeper, shard_map, shards)


async def _drop_lost(stack: _Stack, shard_map: ShardMap, shards: int, lost: frozenset[int]) -> bool:
    """Drop ``lost`` (their leases taken by another coordinator) from ``stack``'s running service.

    Their epochs moved on: nothing of theirs can be written here, and their new holder restored
    them from the store as after a crash. So their calls are refused here at once (moving), their
    locks leave the fence at once (the commits of the shards kept passed meanwhile too, fenced by
    their own shards; one carrying a lost shard's checkpoint is refused), and the service forgets
    their checkpoints without flushing (``CoordinatorService.lose``). A lock replaced (lost and
    taken back) is adopted afterwards.
    """
    kept = frozenset(stack.held) - lost
    names = ", ".join(map(str, sorted(lost)))
    shard_map.held = kept
    for shard in lost:
        stack.fence.remove(shard)
        del stack.held[shard]
    try:
        dropped = await stack.service.lose(
            lambda name: shard_of(name, shards) in lost, owns=lambda name: shard_of(name, shards) in kept
        )
    except Exception as exc:
        log.warning(
            "cannot drop the lost shard(s) %s in place (%s): restarting the service instead", names, exc
        )
        return False
    log.info(
        "dropped the lost shard(s) %s of the store from the running service (%s now at their holder)",
        names,
        count(dropped, "writer"),
    )
    return True


async def _hand_over(
    stack: _Stack, keeper: ShardKeeper, shard_map: ShardMap, shards: int, surplus: frozenset[int]
) -> bool:
    """Give ``surplus`` up in ``stack``'s running service, then let go of their locks; False: restart.

    The reverse of an adoption's order: the shards' calls are refused here first (moving:
    UNAVAILABLE, retried, and routed to the new holder once it has them), then the service lets go
    of their checkpoints (``CoordinatorService.release``: their calls at work finish, their
    writers' journals are made durable, they leave memory without being closed or marked lost),
    and only then do their locks leave the fence and are released, for the new holder to take.
    A commit still carrying one of their checkpoints after that is refused by the fence.
    """
    leaving = surplus & stack.held.keys()
    kept = frozenset(stack.held) - leaving
    names = ", ".join(map(str, sorted(surplus)))
    shard_map.held = kept
    try:
        if leaving:
            let_go = await stack.service.release(
                lambda name: shard_of(name, shards) in leaving,
                owns=lambda name: shard_of(name, shards) in kept,
            )
        else:
            let_go = 0
    except Exception as exc:
        log.warning("cannot hand shard(s) %s over in place (%s): restarting the service instead", names, exc)
        return False
    for shard in leaving:
        stack.fence.remove(shard)
        del stack.held[shard]
    await asyncio.to_thread(keeper.hand_over, surplus)
    log.info(
        "handed shard(s) %s of the store over in place (%s left in the journal for the new holder)",
        names,
        count(let_go, "writer"),
    )
    return True


async def _adopt_gained(stack: _Stack, keeper: ShardKeeper, shard_map: ShardMap, shards: int) -> bool:
    """Adopt the shards the keeper took into ``stack``'s running service; False: restart it instead.

    A gained shard is fenced first (the service's writes for it need its epoch), then restored by
    the service, and served (``shard_map.held``) last: until then its calls are refused here as
    moving (UNAVAILABLE, retried). An adoption that failed (the database out of reach) restarts.
    """
    held = dict(keeper.held)
    if any(held.get(shard) is not lock for shard, lock in stack.held.items()):
        return False  # one lost while another was handed over
    gained = {
        shard: lock for shard, lock in held.items() if shard not in stack.held and shard not in keeper.surplus
    }
    if not gained:
        return True
    adopted = frozenset(gained)
    serving = frozenset(stack.held) | adopted
    names = ", ".join(map(str, sorted(adopted)))
    try:
        for lock in gained.values():
            stack.fence.add(lock)
        restored = await stack.service.adopt(
            lambda name: shard_of(name, shards) in adopted,
            owns=lambda name: shard_of(name, shards) in serving,
        )
    except Exception as exc:
        log.warning(
            "cannot adopt shard(s) %s into the running service (%s): restarting it instead", names, exc
        )
        return False
    stack.held.update(gained)
    shard_map.held = serving
    log.info(
        "adopted shard(s) %s of the store into the running service (%s from the journal)",
        names,
        count(restored, "writer"),
    )
    return True


async def _start_stack(
    settings: Settings,
    shards: int,
    shard_map: ShardMap,
    held: dict[int, StoreLock],
    keeper: ShardKeeper,
    replicas: ReplicaBoard,
    authorizer: Authorizer,
    credentials: grpc.ServerCredentials | None,
    ssl_options: dict[str, Any],
    loop_idle: Callable[[], float] | None,
) -> tuple[_Stack, Settings]:
    """Build and start the service of ``held`` and its servers; returns it and the bound settings."""
    from tally_server.app import (
        _address,
        _HttpThread,
        _mirror_readiness,
        _peer_tls,
        _Uvicorn,
        _watch_store_contact,
        build_service,
        http_config,
        relay_tls,
    )

    loop = asyncio.get_running_loop()
    mine = frozenset(held)
    fence = ShardFence(held, url=store_url(settings.store or ""), store_shards=shards)
    http_sock = bind_http(settings.http_listen)
    http_loop, http_selector = new_event_loop()
    status_board: StatusBoard | None = None
    service: CoordinatorService | None = None
    try:
        idle = [lambda: http_selector.idle_s] + ([loop_idle] if loop_idle else [])
        service = build_service(settings, idle, fence, owns=lambda name: shard_of(name, shards) in mine)
        service.tag_handles(lambda name: handle_tag(shard_of(name, shards)))
        bridged = cast(CoordinatorService, ServiceBridge(service, loop))
        metrics = Metrics(bridged, settings.data_dir)
        status_board = statuses = await asyncio.to_thread(StatusBoard, fence.url, fence, shards)
        service.serve_replicas(
            shard_map.me, functools.partial(replica.list_replicas, replicas), statuses.publish
        )
        service.list_elsewhere(
            statuses.names, lambda names: replica.published_views(statuses.statuses(names))
        )
        await service.start()
        channels = replica.GrpcChannels(settings.max_message_bytes, relay_tls(settings))
        forwarded = metrics.forwarding()
        relay = replica.Relay(shard_map.me, channels, forwarded)
        grpc_server, grpc_port, health = build_server(
            service,
            settings.grpc_listen,
            settings.max_message_bytes,
            metrics=metrics,
            authorizer=authorizer,
            credentials=credentials,
            router=ShardRouter(shard_map, relay),
        )
        scheme = "https" if settings.tls else "http"
        clients: list[httpx.AsyncClient] = []

        def client() -> httpx.AsyncClient:
            if not clients:  # made on the HTTP thread's loop, where it is used
                clients.append(
                    httpx.AsyncClient(
                        timeout=httpx.Timeout(None, connect=5.0), verify=_peer_tls(settings) or True
                    )
                )
            return clients[0]

        def forward(request: Any, owner_of: Any, body: bytes | None) -> Any:
            return replica.relay_http(request, owner_of, client(), scheme, shard_map.me, forwarded, body)

        routed = (HttpShardRouter, {"shard_map": shard_map, "forward": forward})
        config = http_config(
            create_app(bridged, settings, metrics=metrics, authorizer=authorizer, router=routed),
            settings,
            ssl_options,
        )
    except BaseException:
        http_loop.close()
        http_sock.close()
        if status_board is not None:
            status_board.close()
        if service is not None:
            with contextlib.suppress(Exception):
                await service.shutdown()  # its committer thread and database connections
        raise
    http = _HttpThread(_Uvicorn(config), http_sock, http_loop)
    await grpc_server.start()
    tasks = [
        loop.create_task(_mirror_readiness(service, health), name="tally-health"),
        loop.create_task(_watch_store_contact(keeper, service), name="tally-store-contact"),
    ]
    await http.start()
    grpc_host, _ = split_listen(settings.grpc_listen)
    http_host, http_port = http_sock.getsockname()[:2]
    bound = settings.model_copy(
        update={"grpc_listen": _address(grpc_host, grpc_port), "http_listen": _address(http_host, http_port)}
    )
    return _Stack(service, grpc_server, http, tasks, status_board, channels, fence, held), bound


async def _wait_either(event: asyncio.Event, seconds: float) -> None:
    """Wait until ``event`` is set or ``seconds`` have passed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
