"""The ``tally`` command line: the SDK's operator commands, plus what installed packages add.

A distribution adds commands by registering, under the entry-point group ``tally.commands``, a
function that takes the ``typer.Typer`` app; ``tally-server`` adds ``serve`` that way. Without it,
``tally serve`` says what to install instead of "no such command".
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Annotated

import typer

from tally.cli import commands, folders, replay
from tally.cli.common import fail

ENTRY_POINT_GROUP = "tally.commands"

_HELP = "Tally: checkpoint coordination for resumable batch pipelines."


def build_app() -> typer.Typer:
    """The ``tally`` app with every command, those of installed plugins included."""
    app = typer.Typer(help=_HELP, no_args_is_help=True)

    @app.callback()
    def _main() -> None:
        """Tally: checkpoint coordination for resumable batch pipelines."""

    for command in (commands.status, commands.watch, commands.writers, commands.events, commands.replicas):
        app.command()(command)
    app.command()(folders.export)
    app.command(name="import")(folders.import_)
    app.command()(commands.remaining)
    app.command()(commands.failed)
    app.command()(commands.retry)
    app.command()(commands.reset)
    app.command()(folders.inspect)
    app.command()(replay.replay)
    added = _add_plugins(app)
    if "serve" not in added:
        _add_serve_hint(app, added.get("serve-error"))
    return app


def _add_plugins(app: typer.Typer) -> dict[str, str | None]:
    """Register every ``tally.commands`` entry point; returns the names added (or why not)."""
    added: dict[str, str | None] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            register: Callable[[typer.Typer], None] = entry.load()
        except ImportError as exc:
            # A half-installed plugin must not take the operator commands down with it.
            added[f"{entry.name}-error"] = f"{entry.value} cannot be imported: {exc}"
            continue
        register(app)
        added[entry.name] = None
    return added


def _add_serve_hint(app: typer.Typer, why: str | None) -> None:
    def serve(
        args: Annotated[list[str] | None, typer.Argument(hidden=True)] = None,
    ) -> None:
        """Run the coordinator (part of tally-server, which is not installed here)."""
        reason = f" ({why})" if why else ""
        raise fail(
            "tally serve runs the coordinator, which is the tally-server distribution; install it next "
            f"to the SDK (from a Tally checkout: pip install ./client ./server){reason}"
        )

    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
