"""Client configuration: a plain dataclass, optionally read from ``TALLY_*`` environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a :class:`tally.Client` / :class:`tally.AsyncClient`.

    Attributes:
        address: ``host:port`` or ``grpc://host:port`` (gRPC), ``grpcs://`` (gRPC over TLS),
            ``http://host:port`` or ``https://`` (HTTP/JSON API).
        token: Bearer token sent with every call, or None.
        timeout: Seconds a call may take, retries included, before ``Unavailable`` is raised;
            also the default timeout of ``flush()`` and ``close()``.
        max_batch: Most deltas sent in one ApplyDeltas call (the server's limit is higher).
        max_buffered: Deltas a writer buffers before ``apply_deltas`` blocks for room.
        flush_interval_s: Longest time a buffered delta waits before it is sent. Must stay well
            below the server's settle window (250 ms by default).
        retry_initial_s: First backoff delay after a retryable failure.
        retry_max_s: Longest backoff delay.
    """

    address: str = DEFAULT_ADDRESS
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    max_batch: int = 1000
    max_buffered: int = 100_000
    flush_interval_s: float = 0.05
    retry_initial_s: float = 0.05
    retry_max_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address is empty; pass host:port, grpc://host:port or http://host:port")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.max_buffered < 1:
            raise ValueError(f"max_buffered must be at least 1, got {self.max_buffered}")
        if self.flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be positive, got {self.flush_interval_s}")
        if self.retry_initial_s < 0 or self.retry_max_s < self.retry_initial_s:
            raise ValueError(
                f"need 0 <= retry_initial_s <= retry_max_s, got {self.retry_initial_s}, {self.retry_max_s}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientConfig:
        """Read ``TALLY_ADDRESS``, ``TALLY_TOKEN`` and ``TALLY_TIMEOUT``; unset ones keep defaults.

        Args:
            environ: Mapping to read instead of ``os.environ`` (for tests).

        Returns:
            The configuration.

        Raises:
            ValueError: ``TALLY_TIMEOUT`` is not a positive number.
        """
        env = os.environ if environ is None else environ
        timeout = DEFAULT_TIMEOUT
        if raw := env.get("TALLY_TIMEOUT", "").strip():
            try:
                timeout = float(raw)
            except ValueError:
                raise ValueError(f"TALLY_TIMEOUT must be a number of seconds, got {raw!r}") from None
        return cls(
            address=env.get("TALLY_ADDRESS", "").strip() or DEFAULT_ADDRESS,
            token=env.get("TALLY_TOKEN") or None,
            timeout=timeout,
        )
