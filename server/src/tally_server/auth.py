"""Bearer tokens with roles (DESIGN §7), shared by both transports.

With no tokens configured, authentication is off (the default listens on loopback only). With
tokens, every operation needs a token whose role allows it:

* ``reader``: status and the live view (checkpoints, writers, events, progress, watch, are_completed)
* ``worker``: what a reader may, plus writing (open/keepalive/apply/flush/close a writer)
* ``admin``: everything, including reset and import
"""

from __future__ import annotations

import hmac
from enum import IntEnum
from pathlib import Path

from tally_server.errors import PermissionDenied, Unauthenticated


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
    "OpenWriter": Role.WORKER,
    "KeepAlive": Role.WORKER,
    "ApplyDeltas": Role.WORKER,
    "Flush": Role.WORKER,
    "CloseWriter": Role.WORKER,
    "ImportCompleted": Role.ADMIN,
    "ResetCheckpoint": Role.ADMIN,
}


def parse_tokens(spec: str) -> dict[str, Role]:
    """``"tok1:worker,tok2:reader"`` (commas or newlines; ``#`` starts a comment) → {token: role}."""
    tokens: dict[str, Role] = {}
    for raw in spec.replace(",", "\n").splitlines():
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        token, sep, role = entry.rpartition(":")
        if not sep or not token:
            raise ValueError(
                f"token entry {entry!r} must be TOKEN:ROLE with ROLE one of reader, worker, admin"
            )
        try:
            tokens[token.strip()] = Role[role.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown role {role.strip()!r} in token entry; use reader, worker or admin"
            ) from None
    return tokens


def load_tokens(inline: str | None, path: Path | None) -> dict[str, Role]:
    tokens = parse_tokens(inline or "")
    if path is not None:
        tokens.update(parse_tokens(path.read_text()))
    return tokens


class Authorizer:
    """Checks ``Authorization: Bearer <token>`` against the configured tokens."""

    def __init__(self, tokens: dict[str, Role]) -> None:
        self._tokens = dict(tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def check(self, operation: str, authorization: str | None) -> None:
        """Raise Unauthenticated/PermissionDenied unless the header's token may call ``operation``."""
        if not self._tokens:
            return
        required = REQUIRED.get(operation, Role.ADMIN)  # anything unlisted is admin-only
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                f"{operation} needs a bearer token (header 'authorization: Bearer <token>'); pass "
                "token=... to tally.Client or set TALLY_TOKEN"
            )
        role = self._role(token.strip())
        if role is None:
            raise Unauthenticated(f"{operation}: the bearer token is not known to this coordinator")
        if role < required:
            raise PermissionDenied(
                f"{operation} needs the {required.name.lower()} role; this token has {role.name.lower()}"
            )

    def _role(self, token: str) -> Role | None:
        found = None
        for known, role in self._tokens.items():
            # Compare every token in constant time, so timing tells nothing about which matched.
            if hmac.compare_digest(known.encode(), token.encode()):
                found = role
        return found
