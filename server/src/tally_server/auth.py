"""Bearer tokens with roles and optional checkpoint scopes (DESIGN §7), shared by both transports.

With no tokens configured, authentication is off (the default listens on loopback only). With
tokens, every operation needs a token whose role allows it:

* ``reader``: status and the live view (checkpoints, writers, events, progress, watch, are_completed)
* ``worker``: what a reader may, plus writing (open/keepalive/apply/flush/close a writer)
* ``admin``: everything, including reset (``ResetCheckpoint`` and ``OpenWriter`` with
  ``on_mismatch="reset"`` when the fingerprint differs) and import

A token entry is ``TOKEN:ROLE`` (every checkpoint) or ``TOKEN:ROLE@PREFIX`` (only checkpoints whose
name starts with PREFIX, e.g. ``team-a/``). The same token may appear in several entries; each entry
grants its role on its prefix, e.g. ``t:reader`` plus ``t:worker@team-a/`` reads everything and
writes team A's checkpoints only. A scoped token naming a checkpoint outside its prefixes is refused
(PERMISSION_DENIED), ListCheckpoints shows it only the checkpoints it may read, a writer handle
opened under another prefix is refused, and ``/metrics`` (with ``metrics_auth``) needs an
unscoped grant because it names every checkpoint.

The transports authenticate each call (:meth:`Authorizer.check`), make the resulting
:class:`Principal` current for the call (:func:`bind`), and check the checkpoint the request names
against it (:meth:`Principal.require`); handlers read it with :func:`current`.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from tally_server.errors import PermissionDenied, Unauthenticated

__all__ = [
    "CHECKPOINT_FIELD",
    "UNSCOPED_OPERATIONS",
    "HANDLE_OPERATIONS",
    "METRICS",
    "REQUIRED",
    "UNRESTRICTED",
    "Authorizer",
    "Grant",
    "PermissionDenied",
    "Principal",
    "Role",
    "Unauthenticated",
    "bind",
    "current",
    "load_tokens",
    "parse_tokens",
]


class Role(IntEnum):
    """Ordered: each role may do what the roles below it may."""

    READER = 1
    WORKER = 2
    ADMIN = 3


# Operation (the tally.v1 RPC name) → the least role allowed to call it.
REQUIRED: dict[str, Role] = {
    "AreCompleted": Role.READER,
    "GetCheckpoint": Role.READER,
    "ListCheckpoints": Role.READER,
    "ListWriters": Role.READER,
    "ListEvents": Role.READER,
    "GetProgress": Role.READER,
    "WatchCheckpoint": Role.READER,
    "ListCompleted": Role.READER,
    "ListReplicas": Role.READER,
    "GetCursor": Role.READER,
    "SaveCursors": Role.WORKER,
    "ListFailures": Role.READER,
    "ReportFailure": Role.WORKER,
    "RetryFailed": Role.WORKER,
    "SetFailureBudget": Role.WORKER,
    "DeclareSources": Role.WORKER,
    "ListRemaining": Role.READER,
    "Acquire": Role.WORKER,
    "TokenIsCurrent": Role.READER,
    "OpenWriter": Role.WORKER,
    "KeepAlive": Role.WORKER,
    "ApplyDeltas": Role.WORKER,
    "Flush": Role.WORKER,
    "CloseWriter": Role.WORKER,
    "ImportCompleted": Role.ADMIN,
    "ResetCheckpoint": Role.ADMIN,
}

#: The HTTP-only ``GET /metrics`` (guarded only with the ``metrics_auth`` setting).
METRICS = "ScrapeMetrics"
_OTHER: dict[str, Role] = {METRICS: Role.READER}

# Where each operation names the checkpoint it acts on: the request field (gRPC), path or query
# parameter (HTTP) of that name. Checked against a token's scopes before the handler runs.
CHECKPOINT_FIELD: dict[str, str] = {
    "OpenWriter": "checkpoint",
    "AreCompleted": "checkpoint",
    "GetCheckpoint": "name",
    "ListWriters": "checkpoint",
    "ListEvents": "checkpoint",
    "GetProgress": "checkpoint",
    "WatchCheckpoint": "checkpoint",
    "ListCompleted": "checkpoint",
    "ImportCompleted": "checkpoint",
    "ResetCheckpoint": "name",
    "GetCursor": "checkpoint",
    "ListFailures": "checkpoint",
    "RetryFailed": "checkpoint",
    "SetFailureBudget": "checkpoint",
    "DeclareSources": "checkpoint",
    "ListRemaining": "checkpoint",
    "TokenIsCurrent": "checkpoint",
}
#: Operations on an open writer, named by its ``handle``: checked against the handle's checkpoint.
HANDLE_OPERATIONS = frozenset(
    {"KeepAlive", "ApplyDeltas", "Flush", "CloseWriter", "SaveCursors", "ReportFailure", "Acquire"}
)
# Answered with only the checkpoints the token may read (the handler filters), so nothing to check.
_LISTINGS = frozenset({"ListCheckpoints"})
#: Operations about the service itself, naming no checkpoint: only unscoped grants may call them.
UNSCOPED_OPERATIONS = frozenset({"ListReplicas"})

# A scope prefix is the start of a checkpoint name (see domain/validation.py).
_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/\-]*")


def required_role(operation: str) -> Role:
    """The least role ``operation`` needs; anything unlisted is admin-only."""
    return REQUIRED.get(operation) or _OTHER.get(operation) or Role.ADMIN


def _shown(name: str) -> str:
    return repr(name if len(name) <= 100 else name[:97] + "...")


@dataclass(frozen=True)
class Grant:
    """A role on the checkpoints whose name starts with ``prefix`` ("" = every checkpoint)."""

    role: Role
    prefix: str = ""

    def covers(self, checkpoint: str | None) -> bool:
        """Whether this grant reaches ``checkpoint`` (None: every checkpoint at once)."""
        if checkpoint is None:
            return not self.prefix
        return checkpoint.startswith(self.prefix)


@dataclass(frozen=True)
class Principal:
    """What the caller of one operation may do: the grants of its token."""

    grants: tuple[Grant, ...]

    @classmethod
    def unscoped(cls, role: Role) -> Principal:
        """A principal holding ``role`` on every checkpoint."""
        return cls((Grant(role),))

    @property
    def best_role(self) -> Role | None:
        """The highest role of any grant, or None without grants."""
        return max((g.role for g in self.grants), default=None)

    def may(self, operation: str, checkpoint: str | None) -> bool:
        """Whether ``operation`` is allowed on ``checkpoint`` (None: on every checkpoint at once)."""
        needed = required_role(operation)
        return any(g.role >= needed and g.covers(checkpoint) for g in self.grants)

    def may_reset(self, checkpoint: str) -> bool:
        """Whether this caller may start ``checkpoint`` over (by reset or a fingerprint mismatch)."""
        return self.may("ResetCheckpoint", checkpoint)

    def may_read(self, checkpoint: str) -> bool:
        """Whether ``checkpoint`` may appear in this caller's listings."""
        return self.may("GetCheckpoint", checkpoint)

    def require(self, operation: str, checkpoint: str | None) -> None:
        """Raise PermissionDenied unless ``operation`` is allowed on ``checkpoint``."""
        if self.may(operation, checkpoint):
            return
        needed = required_role(operation)
        prefixes = sorted({g.prefix for g in self.grants if g.role >= needed})
        where = ", ".join(_shown(p) for p in prefixes) or "(none)"
        if checkpoint is None:
            raise PermissionDenied(
                f"{operation} covers every checkpoint, so it needs an unscoped token with the "
                f"{needed.name.lower()} role; this token's {needed.name.lower()} grants are limited to "
                f"checkpoints starting with {where}",
                prefixes=prefixes,
            )
        raise PermissionDenied(
            f"{operation} on checkpoint {_shown(checkpoint)} is outside this token's scope: its "
            f"{needed.name.lower()} role covers only checkpoints starting with {where}; use a token "
            "scoped to this checkpoint",
            prefixes=prefixes,
        )

    def require_request(
        self, operation: str, fields: Mapping[str, str], checkpoint_of: Callable[[str], str | None]
    ) -> None:
        """Check that the grants cover the checkpoint a request names.

        That is ``fields[CHECKPOINT_FIELD[operation]]``, or for HANDLE_OPERATIONS the checkpoint of
        ``fields["handle"]`` (``checkpoint_of``).

        An operation whose checkpoint cannot be told is allowed only to unscoped grants, so a scoped
        token is never let through by an operation nobody mapped here.
        """
        if self is UNRESTRICTED or operation in _LISTINGS:
            return
        if operation in HANDLE_OPERATIONS and "handle" in fields:
            checkpoint = checkpoint_of(fields["handle"])
            if checkpoint is not None:  # unknown handle: the service answers NOT_FOUND
                self.require(operation, checkpoint)
            return
        field = CHECKPOINT_FIELD.get(operation)
        self.require(operation, fields[field] if field is not None and field in fields else None)


UNRESTRICTED = Principal.unscoped(Role.ADMIN)
"""The caller when authentication is off: everything is allowed."""

# No grants: what a call sees if a transport forgot to bind its caller (fail closed).
_NOBODY = Principal(())
_CURRENT: ContextVar[Principal] = ContextVar("tally_principal", default=_NOBODY)


def current() -> Principal:
    """The caller of the operation being served (bound by the transport's auth layer)."""
    return _CURRENT.get()


class bind:  # noqa: N801 - used as a function: ``with bind(principal):``
    """Make ``principal`` the caller for the code run inside (and the tasks it starts).

    A class rather than a ``@contextmanager`` generator: entered on every call, and a generator
    costs three times as much.
    """

    __slots__ = ("_principal", "_token")

    def __init__(self, principal: Principal) -> None:
        self._principal = principal

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._principal)

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


def parse_tokens(spec: str) -> dict[str, Principal]:
    """``"t1:worker,t2:reader@team-a/"`` (commas or newlines; ``#`` comments) → {token: principal}.

    An entry is ``TOKEN:ROLE`` or ``TOKEN:ROLE@PREFIX``; a token in several entries gets every grant.
    """
    grants: dict[str, list[Grant]] = {}
    entries = (raw.split("#", 1)[0].strip() for raw in spec.replace(",", "\n").splitlines())
    for number, entry in enumerate((e for e in entries if e), start=1):
        token, sep, rest = entry.rpartition(":")
        if not sep or not token.strip():
            # The entry is not repeated: it may well be a token.
            raise ValueError(
                f"token entry {number} is not TOKEN:ROLE or TOKEN:ROLE@PREFIX (ROLE one of reader, "
                "worker, admin); it is not repeated here, as it may be a secret"
            )
        role_name, at, prefix = rest.partition("@")
        try:
            role = Role[role_name.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown role {role_name.strip()!r} in token entry; use reader, worker or admin"
            ) from None
        prefix = prefix.strip()
        if at and not _PREFIX.fullmatch(prefix):
            raise ValueError(
                f"scope {prefix!r} in a token entry is not a checkpoint name prefix; write "
                "TOKEN:ROLE@PREFIX with PREFIX like 'team-a/' (letters, digits, '.', '_', '-', '/'), "
                "or TOKEN:ROLE for every checkpoint"
            )
        grants.setdefault(token.strip(), []).append(Grant(role, prefix))
    return {token: Principal(tuple(g)) for token, g in grants.items()}


def load_tokens(inline: str | None, path: Path | None) -> dict[str, Principal]:
    """The token table: tokens given inline plus those in the tokens file (grants of one token add up)."""
    tokens = parse_tokens(inline or "")
    if path is not None:
        for token, principal in parse_tokens(path.read_text()).items():
            before = tokens.get(token, Principal(())).grants
            tokens[token] = Principal(before + principal.grants)
    return tokens


class Authorizer:
    """Checks ``Authorization: Bearer <token>`` against the configured tokens."""

    def __init__(self, tokens: Mapping[str, Principal | Role]) -> None:
        self._tokens = {
            token: Principal.unscoped(p) if isinstance(p, Role) else p for token, p in tokens.items()
        }

    @property
    def enabled(self) -> bool:
        """Whether tokens are configured (without them every caller may do everything)."""
        return bool(self._tokens)

    def check(self, operation: str, authorization: str | None) -> Principal:
        """The caller, if the header's token has a role that may call ``operation`` somewhere.

        Whether the checkpoint the call names is within the token's scopes is for
        :meth:`Principal.require`, once the request is read.

        Raises:
            Unauthenticated: no bearer token, or one this coordinator does not know.
            PermissionDenied: the token's roles are all below what ``operation`` needs.
        """
        if not self._tokens:
            return UNRESTRICTED
        required = required_role(operation)
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                f"{operation} needs a bearer token (header 'authorization: Bearer <token>'); pass "
                "token=... to tally.Client or set TALLY_TOKEN"
            )
        principal = self._principal(token.strip())
        if principal is None:
            raise Unauthenticated(f"{operation}: the bearer token is not known to this coordinator")
        best = principal.best_role
        if best is None or best < required:
            has = best.name.lower() if best is not None else "no role"
            raise PermissionDenied(
                f"{operation} needs the {required.name.lower()} role; this token has {has}"
            )
        return principal

    def _principal(self, token: str) -> Principal | None:
        found = None
        for known, principal in self._tokens.items():
            # Compare every token in constant time, so timing tells nothing about which matched.
            if hmac.compare_digest(known.encode(), token.encode()):
                found = principal
        return found
