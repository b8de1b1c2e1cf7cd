"""Token parsing and the role table."""

from __future__ import annotations

import pytest

from tally_server.auth import (
    CHECKPOINT_FIELD,
    HANDLE_OPERATIONS,
    METRICS,
    REQUIRED,
    UNRESTRICTED,
    UNSCOPED_OPERATIONS,
    Authorizer,
    Grant,
    PermissionDenied,
    Principal,
    Role,
    Unauthenticated,
    bind,
    current,
    parse_tokens,
)
from tally_server.errors import ErrorCode


def test_parse_tokens_commas_lines_and_comments() -> None:
    spec = "w-tok:worker, r-tok:reader\n# the operators\nadm:tok:admin  # colons in a token are fine\n"
    assert parse_tokens(spec) == {
        "w-tok": Principal.unscoped(Role.WORKER),
        "r-tok": Principal.unscoped(Role.READER),
        "adm:tok": Principal.unscoped(Role.ADMIN),
    }


def test_parse_tokens_scopes_accumulate_per_token() -> None:
    spec = "t:reader, t:worker@team-a/\nt:admin@team-a/scratch/\na@b:worker@x  # '@' in a token is fine"
    assert parse_tokens(spec) == {
        "t": Principal(
            (Grant(Role.READER), Grant(Role.WORKER, "team-a/"), Grant(Role.ADMIN, "team-a/scratch/"))
        ),
        "a@b": Principal((Grant(Role.WORKER, "x"),)),
    }


@pytest.mark.parametrize("bad", ["justatoken", "tok:owner", ":reader", "tok:owner@team-a/"])
def test_parse_tokens_refuses_bad_entries_with_the_fix(bad: str) -> None:
    with pytest.raises(ValueError, match="reader, worker"):
        parse_tokens(bad)


@pytest.mark.parametrize("bad", ["tok:worker@", "tok:worker@/abs", "tok:worker@a b", "tok:worker@*"])
def test_parse_tokens_refuses_a_scope_that_is_no_name_prefix(bad: str) -> None:
    with pytest.raises(ValueError, match="PREFIX like 'team-a/'"):
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


SCOPED = Authorizer(parse_tokens("ta:worker@team-a/, ta:reader@shared/, ra:reader, adm-a:admin@team-a/"))
HANDLES = {"h-a": "team-a/run", "h-b": "team-b/run"}


def _check(token: str, operation: str, **fields: str) -> None:
    SCOPED.check(operation, f"Bearer {token}").require_request(operation, fields, HANDLES.get)


def test_a_scoped_token_acts_only_under_its_prefixes() -> None:
    _check("ta", "OpenWriter", checkpoint="team-a/run")
    _check("ta", "ApplyDeltas", handle="h-a")
    _check("ta", "GetCheckpoint", name="shared/x")  # its reader grant
    _check("ta", "KeepAlive", handle="unknown")  # no checkpoint to protect: the service says NOT_FOUND
    _check("ta", "ListCheckpoints")  # answered with its checkpoints only
    for operation, fields in [
        ("OpenWriter", {"checkpoint": "team-b/run"}),
        ("AreCompleted", {"checkpoint": "team-b/run"}),
        ("ApplyDeltas", {"handle": "h-b"}),
        ("CloseWriter", {"handle": "h-b"}),
        ("OpenWriter", {"checkpoint": "shared/x"}),  # reader there, not worker
        ("ListEvents", {"checkpoint": "team-ab/run"}),  # prefixes are plain string prefixes
        ("SomethingNew", {"checkpoint": "team-a/run"}),  # unlisted: admin-only
    ]:
        with pytest.raises(PermissionDenied) as denied:
            _check("ta", operation, **fields)
        assert denied.value.code == ErrorCode.PERMISSION_DENIED


def test_the_scope_refusal_names_the_prefixes() -> None:
    with pytest.raises(
        PermissionDenied, match=r"worker role covers only checkpoints starting with 'team-a/'"
    ):
        _check("ta", "ApplyDeltas", handle="h-b")
    with pytest.raises(PermissionDenied) as denied:
        _check("ta", "GetCheckpoint", name="team-b/run")
    assert denied.value.details == {"prefixes": ["shared/", "team-a/"]}


def test_an_operation_whose_checkpoint_cannot_be_told_needs_an_unscoped_grant() -> None:
    with pytest.raises(PermissionDenied, match="every checkpoint"):
        _check("ta", "GetCheckpoint")  # e.g. a new route that names its checkpoint elsewhere
    _check("ra", "GetCheckpoint")


def test_reset_and_metrics_need_the_right_grant() -> None:
    ta = SCOPED.check("OpenWriter", "Bearer ta")
    admin_a = SCOPED.check("OpenWriter", "Bearer adm-a")
    assert not ta.may_reset("team-a/run")
    assert admin_a.may_reset("team-a/run") and not admin_a.may_reset("team-b/run")
    assert UNRESTRICTED.may_reset("anything")
    SCOPED.check(METRICS, "Bearer ra").require(METRICS, None)
    with pytest.raises(PermissionDenied, match="unscoped token"):
        SCOPED.check(METRICS, "Bearer ta").require(METRICS, None)


def test_listings_show_what_the_token_may_read() -> None:
    ta = SCOPED.check("ListCheckpoints", "Bearer ta")
    names = ["team-a/run", "team-b/run", "shared/x"]
    assert [n for n in names if ta.may_read(n)] == ["team-a/run", "shared/x"]


def test_the_current_caller_fails_closed_when_nothing_was_bound() -> None:
    assert not current().may_read("x") and not current().may_reset("x")
    with bind(UNRESTRICTED):
        assert current().may_reset("x")
    assert not current().may_reset("x")


def test_every_rpc_says_where_its_checkpoint_is() -> None:
    """A new RPC must be mapped, or scoped tokens are refused it (fail closed): this says which."""
    from tally.v1 import coordinator_pb2 as pb

    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        fields = set(method.input_type.fields_by_name)
        if method.name in HANDLE_OPERATIONS:
            assert "handle" in fields, method.name
        elif method.name == "ListCheckpoints" or method.name in UNSCOPED_OPERATIONS:
            assert not fields & {"checkpoint", "name", "handle"}
        else:
            assert CHECKPOINT_FIELD.get(method.name) in fields, method.name
