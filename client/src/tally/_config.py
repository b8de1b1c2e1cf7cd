"""Client configuration: a plain dataclass, optionally read from ``TALLY_*`` environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 30.0
_TLS_ENV = {"ca_cert": "TALLY_CA_CERT", "client_cert": "TALLY_CLIENT_CERT", "client_key": "TALLY_CLIENT_KEY"}


def is_tls_address(address: str) -> bool:
    """Whether ``address`` (or any address of a comma-separated list) asks for TLS (``grpcs://``,
    ``https://``); a list that mixes TLS and plain text is refused when the client is made."""
    return any(part.strip().lower().startswith(("grpcs://", "https://")) for part in address.split(","))


def tls_files_from_env(address: str, environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``TALLY_CA_CERT``, ``TALLY_CLIENT_CERT`` and ``TALLY_CLIENT_KEY``, for a TLS ``address`` only.

    Set once for a shell, they must not break a client pointed at a plain-text address.
    """
    env = os.environ if environ is None else environ
    if not is_tls_address(address):
        return {name: None for name in _TLS_ENV}
    return {name: env.get(var) or None for name, var in _TLS_ENV.items()}


def read_pem(what: str, path: str) -> bytes:
    """The bytes of a PEM file, or a ValueError that names the setting and the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path!r} cannot be read ({err.strerror or err}); give a PEM file") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a :class:`tally.Client` / :class:`tally.AsyncClient`.

    Attributes:
        address: ``host:port`` or ``grpc://host:port`` (gRPC), ``grpcs://`` (gRPC over TLS),
            ``http://host:port`` or ``https://`` (HTTP/JSON API); or a comma-separated list of
            coordinator replicas, all of one wire and all TLS or none, e.g.
            ``h1:50051,h2:50051``: the client starts on a random one and moves to the next when
            one is unavailable (see :class:`tally.Client`).
        token: Bearer token sent with every call, or None.
        timeout: Seconds a call may take, retries included, before ``Unavailable`` is raised;
            also the default timeout of ``flush()`` and ``close()``.
        max_batch: Most deltas sent in one ApplyDeltas call (the server's limit is higher). A
            writer sends what has accumulated while its previous batch was out, up to this many:
            fewer, larger calls cost the coordinator less CPU per delta.
        max_buffered: Deltas a writer buffers before ``apply_deltas`` blocks for room.
        max_batches_in_flight: Most batches a writer has on the wire at once, when the
            coordinator allows as many (gRPC and HTTP; one at a time with an older one): the
            next batch travels while the coordinator applies the one before it, which still
            applies first. Over HTTP each batch on the wire has a connection of its own.
        flush_interval_s: Longest time a buffered delta waits before it is sent. Must stay well
            below the server's settle window (250 ms by default).
        retry_initial_s: First backoff delay after a retryable failure.
        retry_max_s: Longest backoff delay.
        ca_cert: PEM file of the CA(s) that signed the coordinator's certificate, for ``grpcs://``
            and ``https://``; None trusts the system's root certificates.
        client_cert: PEM certificate presented to a coordinator that requires client certificates
            (mutual TLS); needs ``client_key``.
        client_key: PEM private key of ``client_cert``.
        connect_wait: Seconds after the client is made during which a refused connection to a
            coordinator that never answered is retried (a coordinator still starting, or
            restarting). 0, the default: it fails at once, saying no coordinator listens there.
    """

    address: str = DEFAULT_ADDRESS
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    max_batch: int = 10_000
    max_buffered: int = 100_000
    max_batches_in_flight: int = 2
    flush_interval_s: float = 0.05
    retry_initial_s: float = 0.05
    retry_max_s: float = 5.0
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    connect_wait: float = 0.0

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address is empty; pass host:port, grpc://host:port or http://host:port")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if not self.connect_wait >= 0:
            raise ValueError(f"connect_wait must be 0 or more seconds, got {self.connect_wait}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.max_buffered < 1:
            raise ValueError(f"max_buffered must be at least 1, got {self.max_buffered}")
        if self.max_batches_in_flight < 1:
            raise ValueError(f"max_batches_in_flight must be at least 1, got {self.max_batches_in_flight}")
        if self.flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be positive, got {self.flush_interval_s}")
        if self.retry_initial_s < 0 or self.retry_max_s < self.retry_initial_s:
            raise ValueError(
                f"need 0 <= retry_initial_s <= retry_max_s, got {self.retry_initial_s}, {self.retry_max_s}"
            )
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together: give both for mutual TLS, or neither")
        tls_files = [n for n in ("ca_cert", "client_cert", "client_key") if getattr(self, n) is not None]
        if tls_files and not is_tls_address(self.address):
            raise ValueError(
                f"{', '.join(tls_files)} given but address {self.address!r} is not TLS; use "
                "grpcs://host:port or https://host:port"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientConfig:
        """Read ``TALLY_ADDRESS``, ``TALLY_TOKEN``, ``TALLY_TIMEOUT``, ``TALLY_CONNECT_WAIT``,
        ``TALLY_CA_CERT``, ``TALLY_CLIENT_CERT`` and ``TALLY_CLIENT_KEY``; unset ones keep defaults.
        The three TLS files apply only when the address is ``grpcs://`` or ``https://``.

        Args:
            environ: Mapping to read instead of ``os.environ`` (for tests).

        Returns:
            The configuration.

        Raises:
            ValueError: ``TALLY_TIMEOUT`` is not a positive number, ``TALLY_CONNECT_WAIT`` not a
                number, or the TLS files do not fit the address (see the attributes).
        """
        env = os.environ if environ is None else environ
        timeout = DEFAULT_TIMEOUT
        if raw := env.get("TALLY_TIMEOUT", "").strip():
            try:
                timeout = float(raw)
            except ValueError:
                raise ValueError(f"TALLY_TIMEOUT must be a number of seconds, got {raw!r}") from None
        connect_wait = 0.0
        if raw := env.get("TALLY_CONNECT_WAIT", "").strip():
            try:
                connect_wait = float(raw)
            except ValueError:
                raise ValueError(f"TALLY_CONNECT_WAIT must be a number of seconds, got {raw!r}") from None
        address = env.get("TALLY_ADDRESS", "").strip() or DEFAULT_ADDRESS
        tls = tls_files_from_env(address, env)
        return cls(
            address=address,
            token=env.get("TALLY_TOKEN") or None,
            timeout=timeout,
            connect_wait=connect_wait,
            ca_cert=tls["ca_cert"],
            client_cert=tls["client_cert"],
            client_key=tls["client_key"],
        )
