"""``tally serve``: the coordinator's command, added to the SDK's ``tally`` command.

The ``tally`` console script belongs to the SDK (``tally-client[cli]``, with the operator
commands); this distribution registers :func:`register` under the ``tally.commands`` entry-point
group, so ``tally serve`` exists wherever the server is installed. Only typer is imported up front:
``tally status`` loads this module too, and must stay quick.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.main
from typer.core import TyperCommand

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic.fields import FieldInfo

_HELP = """Run the coordinator (gRPC + HTTP) until SIGTERM.

Every option is also the environment variable shown with it (a flag wins over the environment).
Bearer tokens: TALLY_TOKENS="TOKEN:ROLE,TOKEN:ROLE@PREFIX" (roles reader, worker, admin) or
--tokens-file; with neither, authentication is off.
"""


def serve() -> None:
    """Run the coordinator (gRPC + HTTP) until SIGTERM."""


class _SettingsCommand(TyperCommand):
    """``tally serve``, whose options are built from :class:`Settings` when it runs or shows its help.

    Built then and not when the ``tally`` app is, because the other commands (``tally status``)
    load this module too and must not import pydantic for it.
    """

    _built = False

    def _build(self) -> None:
        if self._built:
            return
        real = typer.main.get_command(_serve_app())
        self.params = real.params
        self.callback = real.callback
        self.help = real.help
        # Plain click help: rich's narrow option table cuts long words (URLs, paths) with "…", and
        # would read the "[env var: ...]" in a description as markup.
        self.rich_markup_mode = None
        self._built = True

    # typer's own click (typer._click) types these; Any keeps this module off its private names.
    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        self._build()
        return super().make_context(info_name, args, parent, **extra)

    def get_params(self, ctx: Any) -> list[Any]:
        self._build()
        return super().get_params(ctx)


def _serve_app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command(help=_HELP)(settings_command())
    return app


def env_var(name: str) -> str:
    """The environment variable of the setting ``name``: ``data_dir`` → ``TALLY_DATA_DIR``."""
    return f"TALLY_{name.upper()}"


def flag(name: str) -> str:
    """The flag of the setting ``name``: ``data_dir`` → ``--data-dir``."""
    return "--" + name.replace("_", "-")


def shown_default(field: FieldInfo) -> str:
    """A setting's default as ``tally serve --help`` shows it (``default_text`` says what unset means)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("default_text"), str):
        return str(extra["default_text"])
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Path) and not value.is_absolute():
        return f"./{value}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _flag_type(annotation: Any) -> Any:
    """The type a flag parses: the setting's, without its ``| None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def settings_command() -> Callable[..., None]:
    """The ``serve`` function typer turns into a command: one ``--flag`` per :class:`Settings` field.

    A flag's help is the field's description, its environment variable (once) and its default;
    a flag left out is None here, so the environment or the default applies.
    """
    from tally_server.settings import Settings

    parameters = []
    for name, field in Settings.model_fields.items():
        kind = _flag_type(field.annotation)
        decl = f"{flag(name)}/--no-{flag(name)[2:]}" if kind is bool else flag(name)
        option = typer.Option(
            decl,
            help=f"{field.description} [env var: {env_var(name)}; default: {shown_default(field)}]",
            show_default=False,
        )
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
            )
        )

    def run_serve(**flags: Any) -> None:
        _run(flags)

    run_serve.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    run_serve.__annotations__ = {p.name: p.annotation for p in parameters}
    run_serve.__name__ = "serve"
    return run_serve


def _run(flags: dict[str, Any]) -> None:
    from pydantic import ValidationError

    from tally_server import logs
    from tally_server.settings import Settings

    given = {k: v for k, v in flags.items() if v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        for line in settings_errors(exc, set(given)):
            typer.echo(f"tally serve: {line}", err=True)
        raise typer.Exit(2) from None
    logs.configure(settings.log_level, settings.log_format)
    from tally_server.app import run

    try:
        run(settings)
    except OSError as exc:
        typer.echo(f"tally serve: {exc}", err=True)
        raise typer.Exit(1) from None


# Values never repeated in an error: they may hold passwords or tokens.
_SECRET_FIELDS = frozenset({"tokens", "registry_url", "store"})


def settings_errors(exc: ValidationError, flags: set[str]) -> list[str]:
    """One line per invalid setting, naming it as the user gave it (``--flag`` or ``TALLY_*``).

    pydantic names its fields (``lease_ttl_s``) and adds its own error codes and links; a user
    set ``TALLY_LEASE_TTL_S`` or ``--lease-ttl-s``, and wants to know what is expected.

    Args:
        exc: The error of ``Settings(...)``.
        flags: The fields given as flags (the others came from the environment or a default).
    """
    lines = []
    for error in exc.errors(include_url=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        message = message[:1].lower() + message[1:]
        if not error["loc"]:  # a rule across fields: its message names them
            lines.append(message)
            continue
        field = str(error["loc"][0])
        value = error.get("input")
        if field in flags:
            name = f"--{field.replace('_', '-')}"
            shown = "" if field in _SECRET_FIELDS else f" {value}"
        else:
            name = f"TALLY_{field.upper()}"
            shown = "" if field in _SECRET_FIELDS else f"={value}"
        lines.append(f"{name}{shown} is not valid: {message}")
    return lines


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``tally`` command (the ``tally.commands`` entry point)."""
    app.command(cls=_SettingsCommand)(serve)


def main() -> None:
    """``python -m tally_server``: the ``tally`` command, as the console script runs it."""
    from tally.cli import main as tally_main

    tally_main()
