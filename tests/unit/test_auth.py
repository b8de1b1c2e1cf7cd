"""Token parsing and the role table."""

from __future__ import annotations

import pytest

from tally_server.auth import REQUIRED, Authorizer, PermissionDenied, Role, Unauthenticated, parse_tokens
from tally_server.errors import ErrorCode


def test_parse_tokens_commas_lines_and_comments() -> None:
    spec = "w-tok:worker, r-tok:reader\n# the operators\nadm:tok:admin  # colons in a token are fine\n"
    assert parse_tokens(spec) == {"w-tok": Role.WORKER, "r-tok": Role.READER, "adm:tok": Role.ADMIN}


@pytest.mark.parametrize("bad", ["justatoken", "tok:owner", ":reader"])
def test_parse_tokens_refuses_bad_entries_with_the_fix(bad: str) -> None:
    with pytest.raises(ValueError, match="reader, worker"):
        parse_tokens(bad)


def test_disabled_without_tokens() -> None:
    Authorizer({}).check("ResetCheckpoint", None)  # no tokens configured: everything is allowed
    assert not Authorizer({}).enabled


AUTH = Authorizer({"r": Role.READER, "w": Role.WORKER, "a": Role.ADMIN})


@pytest.mark.parametrize(
    ("operation", "allowed"),
    [
        ("GetCheckpoint", {"r", "w", "a"}),
        ("AreCompleted", {"r", "w", "a"}),
        ("ApplyDeltas", {"w", "a"}),
        ("OpenWriter", {"w", "a"}),
        ("ResetCheckpoint", {"a"}),
        ("ImportCompleted", {"a"}),
        ("SomethingNew", {"a"}),  # unlisted operations are admin-only
    ],
)
def test_roles(operation: str, allowed: set[str]) -> None:
    for token in ("r", "w", "a"):
        if token in allowed:
            AUTH.check(operation, f"Bearer {token}")
        else:
            with pytest.raises(PermissionDenied) as denied:
                AUTH.check(operation, f"Bearer {token}")
            assert denied.value.code == ErrorCode.PERMISSION_DENIED
            assert "role" in denied.value.message


@pytest.mark.parametrize("header", [None, "", "Bearer ", "Basic abc", "Bearer nope"])
def test_missing_or_unknown_token_is_unauthenticated(header: str | None) -> None:
    with pytest.raises(Unauthenticated) as refused:
        AUTH.check("GetCheckpoint", header)
    assert refused.value.code == ErrorCode.UNAUTHENTICATED


def test_every_rpc_of_the_service_has_a_role() -> None:
    from tally.v1 import coordinator_pb2 as pb

    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods}
    assert rpcs == set(REQUIRED)
