"""The no-I/O half of :class:`tally.Client` and :class:`tally.AsyncClient`: configuration, argument
checks and the plans of calls each method runs (httpx's ``BaseClient``)."""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Iterable, Mapping
from typing import get_args

from tally import _calls as calls
from tally._config import ClientConfig, tls_files_from_env
from tally._labels import environment_labels
from tally._retry import Deadline, RetryPolicy
from tally._transport.contact import NeverReached
from tally._types import (
    CheckpointStatus,
    CompletedPage,
    EventPage,
    FailurePage,
    ImportResult,
    OnMismatch,
    ProgressSample,
    Replicas,
    ResetResult,
    WriterSpec,
    WriterStatus,
)
from tally._writer import WriterBase, default_writer_id
from tally.errors import FailedPrecondition, Internal, InvalidArgument, Unavailable

logger = logging.getLogger(__name__)

# What a writer asks for when its fingerprint differs from the checkpoint's recorded one.
_ON_MISMATCH: tuple[OnMismatch, ...] = get_args(OnMismatch)


def resolve_config(
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
        connect_wait=env.connect_wait,
        ca_cert=files["ca_cert"],
        client_cert=files["client_cert"],
        client_key=files["client_key"],
    )


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
            Unavailable: No status arrived for ``timeout`` seconds, or the first connection was
                refused (nothing to wait for).
        """
        if isinstance(err, NeverReached):
            raise err
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
        if self._attempt == 1:
            logger.warning(
                "%s: %s; reconnecting for up to %.0fs", self._what, err.message, self._deadline.remaining()
            )
        return delay


class BaseClient:
    """State and call building shared by :class:`Client` and :class:`AsyncClient` (no I/O).

    Each public method of the two clients is "build the plan here, run it there": the plan
    builders below check arguments and describe the calls (``tally._calls``); the flavours only
    run plans (``_run``) and the two streams.
    """

    _writers: weakref.WeakSet[WriterBase]

    def _setup(self, config: ClientConfig) -> None:
        self._config = config
        self._policy = RetryPolicy(config.retry_initial_s, config.retry_max_s)
        # Weak: a writer the user dropped must not be kept alive by its client.
        self._writers = weakref.WeakSet()
        self._closed = False

    @property
    def address(self) -> str:
        """The coordinator address this client was given (a comma-separated list for replicas)."""
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
        on_mismatch: OnMismatch = "refuse",
        max_attempts: int | None = None,
        expected_sources: Iterable[str] | int | None = None,
    ) -> WriterSpec:
        self._check_open()
        if max_attempts is not None:
            calls.max_attempts(max_attempts)
        expected = None if expected_sources is None else calls.expected_sources(expected_sources)
        if on_mismatch not in _ON_MISMATCH:
            raise InvalidArgument(
                f"on_mismatch must be one of {', '.join(_ON_MISMATCH)}, got {on_mismatch!r}"
            )
        if not isinstance(checkpoint, str) or not checkpoint:
            raise InvalidArgument(f"checkpoint must be a non-empty string, got {checkpoint!r}")
        if writer_id is not None and (not isinstance(writer_id, str) or not writer_id):
            raise InvalidArgument(f"writer_id must be a non-empty string or None, got {writer_id!r}")
        # SLURM and NeMo Curator shard ids, so the dashboard can tell array tasks and shards apart.
        merged = environment_labels()
        merged.update(_str_map("labels", labels))
        return WriterSpec(
            checkpoint=checkpoint,
            writer_id=writer_id or default_writer_id(),
            fingerprint=_str_map("fingerprint", fingerprint),
            labels=merged,
            host=socket.gethostname(),
            pid=os.getpid(),
            on_mismatch=on_mismatch,
            max_attempts=max_attempts,
            expected_sources=expected,
        )

    def _open_writers(self) -> list[WriterBase]:
        return [w for w in list(self._writers) if w.health().open]

    def _name(self, checkpoint: object) -> str:
        self._check_open()
        if not isinstance(checkpoint, str) or not checkpoint:
            raise InvalidArgument(f"checkpoint must be a non-empty string, got {checkpoint!r}")
        return checkpoint

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
    def _interval_ms(interval_s: float) -> int:
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not interval_s > 0:
            raise InvalidArgument(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        return max(1, round(interval_s * 1000))

    def _reconnect(self, checkpoint: str) -> _Reconnect:
        return _Reconnect(self._policy, self._config.timeout, f"watch {checkpoint!r}")

    def _stream_ended(self, checkpoint: str) -> Unavailable:
        return Unavailable(f"the coordinator at {self._config.address} ended the watch of {checkpoint!r}")

    # ------------------------------------------------------------------ plans (no I/O)

    def _are_completed_plan(self, checkpoint: str, ids: Iterable[str]) -> calls.Plan[list[bool]]:
        self._check_open()
        return calls.are_completed(checkpoint, ids)

    def _cursor_plan(self, checkpoint: str, source_id: str) -> calls.Plan[bytes | None]:
        return calls.get_cursor(self._name(checkpoint), source_id)

    def _token_plan(self, checkpoint: str, source_id: str, token: int) -> calls.Plan[bool]:
        source_id = calls.failure_source_id(source_id)
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidArgument(f"token must be an integer (a Claim's token), got {token!r}")
        return calls.single(calls.TokenIsCurrent(self._name(checkpoint), source_id, token))

    def _checkpoint_plan(self, name: str) -> calls.Plan[CheckpointStatus]:
        self._check_open()
        return calls.single(calls.GetCheckpoint(name))

    def _checkpoints_plan(self, page_size: int, writers: bool) -> calls.Plan[list[CheckpointStatus]]:
        self._check_open()
        return calls.list_checkpoints(_positive_int("page_size", page_size), writers)

    def _replicas_plan(self) -> calls.Plan[Replicas]:
        self._check_open()
        return calls.single(calls.ListReplicas())

    def _writers_plan(
        self, checkpoint: str, include_closed: bool, limit: int | None, page_size: int
    ) -> calls.Plan[list[WriterStatus]]:
        name = self._name(checkpoint)
        most = None if limit is None else _positive_int("limit", limit)
        return calls.list_writers(name, bool(include_closed), most, _positive_int("page_size", page_size))

    def _events_plan(self, checkpoint: str, limit: int, before_id: int | None) -> calls.Plan[EventPage]:
        name = self._name(checkpoint)
        limit, before_id = self._events_args(limit, before_id)
        return calls.single(calls.ListEvents(name, limit, before_id))

    def _progress_plan(self, checkpoint: str, since: float | None) -> calls.Plan[list[ProgressSample]]:
        name, since = self._name(checkpoint), self._since(since)
        return calls.single(calls.GetProgress(name, since))

    def _import_plan(
        self, checkpoint: str, source_ids: Iterable[str], import_id: str
    ) -> calls.Plan[ImportResult]:
        return calls.import_completed(self._name(checkpoint), source_ids, import_id)

    def _reset_plan(self, checkpoint: str, force: bool) -> calls.Plan[ResetResult]:
        return calls.reset(self._name(checkpoint), bool(force))

    def _failures_args(
        self, checkpoint: str, source_ids: Iterable[str] | None, page_size: int
    ) -> tuple[str, list[str] | None, int]:
        name, size = self._name(checkpoint), _positive_int("page_size", page_size)
        return name, None if source_ids is None else calls.id_list("source_ids", source_ids), size

    @staticmethod
    def _next_failures(after: str, page: FailurePage) -> str | None:
        """The cursor of the next page of failures, or None after the last one."""
        if not page.next_after:
            return None
        if page.next_after <= after:
            raise Internal(
                f"the coordinator's failures cursor went backwards: {after!r} -> {page.next_after!r}"
            )
        return page.next_after

    def _retry_failed_plan(self, checkpoint: str, source_ids: Iterable[str] | None) -> calls.Plan[int]:
        name = self._name(checkpoint)
        ids = None if source_ids is None else calls.id_list("source_ids", source_ids)
        return calls.retry_failed(name, ids)

    def _set_max_attempts_plan(self, checkpoint: str, max_attempts: int) -> calls.Plan[int]:
        name = self._name(checkpoint)
        return calls.failed_under(calls.SetFailureBudget(name, calls.max_attempts(max_attempts)))

    def _declare_plan(self, checkpoint: str, ids: Iterable[str] | None, count: int | None) -> calls.Plan[int]:
        return calls.declare_plan(self._name(checkpoint), ids, count)

    def _completed_args(self, checkpoint: str, page_size: int) -> tuple[str, int]:
        return self._name(checkpoint), _positive_int("page_size", page_size)

    def _watch_call(self, checkpoint: str, interval_s: float) -> calls.WatchCheckpoint:
        return calls.WatchCheckpoint(self._name(checkpoint), self._interval_ms(interval_s))
