"""The sync and async flavours expose the same public surface (httpx-style parity check)."""

from __future__ import annotations

import inspect

import pytest

import tally

# Methods that do I/O are coroutines in the async flavour; everything else is identical. Streams
# (``completed``, ``remaining``, ``watch``) are plain calls in both that return an iterator / async iterator.
ASYNC_METHODS = {
    (tally.Client, tally.AsyncClient): {
        "are_completed",
        "checkpoint",
        "checkpoints",
        "close",
        "cursor",
        "declare",
        "events",
        "import_completed",
        "progress",
        "replicas",
        "reset",
        "retry_failed",
        "set_max_attempts",
        "token_is_current",
        "writers",
    },
    (tally.Writer, tally.AsyncWriter): {
        "open",
        "are_completed",
        "declare",
        "cursor",
        "flush",
        "close",
        "report_failure",
        "acquire",
    },
}
PAIRS = list(ASYNC_METHODS)


def public_members(cls: type) -> dict[str, object]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


def normalized(annotation: object) -> str:
    # The async flavour returns its own types (AsyncWriter, AsyncIterator ...); otherwise they match.
    text = str(annotation)
    for name in ("Writer", "Client", "Iterator"):
        text = text.replace(f"Async{name}", name)
    return text


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_same_public_names(sync_cls: type, async_cls: type) -> None:
    assert sorted(public_members(sync_cls)) == sorted(public_members(async_cls))


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_same_parameters_and_kinds(sync_cls: type, async_cls: type) -> None:
    sync_members, async_members = public_members(sync_cls), public_members(async_cls)
    for name, sync_member in sync_members.items():
        async_member = async_members[name]
        assert type(sync_member) is type(async_member), name  # property / classmethod / function
        if isinstance(sync_member, property):
            assert sync_member.fget is not None and async_member.fget is not None  # type: ignore[attr-defined]
            s_ret = inspect.signature(sync_member.fget).return_annotation
            a_ret = inspect.signature(async_member.fget).return_annotation  # type: ignore[attr-defined]
            assert normalized(s_ret) == normalized(a_ret), name
            continue
        s_fn = getattr(sync_cls, name)
        a_fn = getattr(async_cls, name)
        s_params = list(inspect.signature(s_fn).parameters.values())
        a_params = list(inspect.signature(a_fn).parameters.values())
        assert [(p.name, p.kind, p.default, normalized(p.annotation)) for p in s_params] == [
            (p.name, p.kind, p.default, normalized(p.annotation)) for p in a_params
        ], name
        assert normalized(inspect.signature(s_fn).return_annotation) == normalized(
            inspect.signature(a_fn).return_annotation
        ), name


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_io_methods_are_coroutines_only_in_the_async_flavour(sync_cls: type, async_cls: type) -> None:
    io_methods = ASYNC_METHODS[(sync_cls, async_cls)]
    for name, member in public_members(async_cls).items():
        if isinstance(member, property | classmethod):
            continue
        assert inspect.iscoroutinefunction(getattr(async_cls, name)) == (name in io_methods), name
        assert not inspect.iscoroutinefunction(getattr(sync_cls, name)), name


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_constructors_and_context_managers_match(sync_cls: type, async_cls: type) -> None:
    assert (
        inspect.signature(sync_cls.__init__).parameters.keys()
        == inspect.signature(async_cls.__init__).parameters.keys()
    )
    assert hasattr(sync_cls, "__enter__") and hasattr(sync_cls, "__exit__")
    assert inspect.iscoroutinefunction(async_cls.__aenter__) and inspect.iscoroutinefunction(
        async_cls.__aexit__
    )


def test_streams_are_iterators_in_both_flavours() -> None:
    for name in ("completed", "remaining", "watch"):
        assert inspect.signature(getattr(tally.Client, name)).return_annotation.startswith("Iterator[")
        assert inspect.signature(getattr(tally.AsyncClient, name)).return_annotation.startswith(
            "AsyncIterator["
        )


def test_apply_deltas_stays_a_plain_call_in_both() -> None:
    assert not inspect.iscoroutinefunction(tally.AsyncWriter.apply_deltas)
    assert tally.AsyncWriter.apply_deltas is tally.Writer.apply_deltas  # one shared implementation
