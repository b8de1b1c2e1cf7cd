"""Client and AsyncClient over a shared base that does no I/O."""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Self

from tally._config import ClientConfig
from tally._ops import are_completed, async_are_completed
from tally._retry import Deadline, RetryPolicy, async_call_with_retry, call_with_retry
from tally._transport import AsyncTransport, Transport, make_async_transport, make_transport
from tally._types import CheckpointStatus, WriterSpec
from tally._writer import AsyncWriter, Writer, _WriterBase, default_writer_id
from tally.errors import FailedPrecondition, InvalidArgument, TallyError

logger = logging.getLogger(__name__)

# SLURM job identity, added to writer labels so the dashboard can tell array tasks apart.
_SLURM_LABELS = {
    "SLURM_JOB_ID": "slurm_job_id",
    "SLURM_ARRAY_JOB_ID": "slurm_array_job_id",
    "SLURM_ARRAY_TASK_ID": "slurm_array_task_id",
}


def _resolve_config(address: str | None, token: str | None, timeout: float | None) -> ClientConfig:
    env = ClientConfig.from_env()
    return ClientConfig(
        address=address or env.address,
        token=(token if token is not None else env.token) or None,
        timeout=timeout if timeout is not None else env.timeout,
    )


def _str_map(name: str, value: Mapping[str, str] | None) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidArgument(f"{name} must be a mapping of str to str, got {value!r}")
    return dict(value)


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
    ) -> WriterSpec:
        self._check_open()
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
        )

    def _open_writers(self) -> list[_WriterBase]:
        return [w for w in list(self._writers) if w.health().open]


class Client(_BaseClient):
    """Blocking client of a Tally coordinator.

    Example::

        client = tally.Client("grpc://coordinator:50051", token=token)
        with client.writer("curation/run-42", fingerprint={"pipeline": h1}) as w:
            todo = [s for s, done in zip(sources, w.are_completed(sources)) if not done]
            w.apply_deltas([(task_id, source_id, +1)])
    """

    def __init__(self, address: str | None = None, *, token: str | None = None, timeout: float | None = None):
        """Create a client; no connection is made until the first call.

        Args:
            address: ``host:port`` or ``grpc://host:port`` (gRPC), ``grpcs://`` (TLS),
                ``http://host:port`` or ``https://`` (HTTP/JSON). Defaults to ``$TALLY_ADDRESS``,
                else ``127.0.0.1:50051``.
            token: Bearer token; defaults to ``$TALLY_TOKEN``.
            timeout: Seconds each call may take, retries included; defaults to ``$TALLY_TIMEOUT``,
                else 30.

        Raises:
            ValueError: The address has an unsupported scheme.
        """
        config = _resolve_config(address, token, timeout)
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
    ) -> Writer:
        """Create a writer of ``checkpoint``; it opens on ``with`` (or :meth:`Writer.open`).

        Args:
            checkpoint: Checkpoint name, e.g. ``curation/run-42``.
            writer_id: Defaults to ``<hostname>-<pid>``, like NeMo Curator.
            fingerprint: Named components identifying the pipeline and its input; a later writer
                whose components differ is refused.
            labels: Free-form labels shown in status views (SLURM job ids are added automatically).

        Returns:
            An unopened :class:`Writer`.
        """
        writer = Writer(
            self._transport, self._writer_spec(checkpoint, writer_id, fingerprint, labels), self._config
        )
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

    def __init__(self, address: str | None = None, *, token: str | None = None, timeout: float | None = None):
        """Create a client; no connection is made until the first call. See :class:`Client`."""
        config = _resolve_config(address, token, timeout)
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
    ) -> AsyncWriter:
        """Create a writer of ``checkpoint``; it opens on ``async with``. See :meth:`Client.writer`."""
        spec = self._writer_spec(checkpoint, writer_id, fingerprint, labels)
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
