"""``tally serve``: the coordinator's command, added to the SDK's ``tally`` command.

The ``tally`` console script belongs to the SDK (``tally-client[cli]``, with the operator
commands); this distribution registers :func:`register` under the ``tally.commands`` entry-point
group, so ``tally serve`` exists wherever the server is installed. Only typer is imported up front:
``tally status`` loads this module too, and must stay quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pydantic import ValidationError


def serve(
    data_dir: Annotated[
        Path | None, typer.Option(help="Data directory [env TALLY_DATA_DIR; ./tally-data].")
    ] = None,
    grpc_listen: Annotated[
        str | None, typer.Option(help="gRPC HOST:PORT, 0 = free port [TALLY_GRPC_LISTEN; 127.0.0.1:50051].")
    ] = None,
    http_listen: Annotated[
        str | None, typer.Option(help="HTTP HOST:PORT, 0 = free port [TALLY_HTTP_LISTEN; 127.0.0.1:8080].")
    ] = None,
    registry_url: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the registry [TALLY_REGISTRY_URL; SQLite in data dir]."),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="postgresql+psycopg://USER@HOST/DB: completions and journals in PostgreSQL "
            "[TALLY_STORE; LMDB files in data dir]."
        ),
    ] = None,
    standby: Annotated[
        bool | None,
        typer.Option(
            "--standby/--no-standby",
            help="With --store: wait while another coordinator serves it, take over when it is gone "
            "[TALLY_STANDBY; off].",
        ),
    ] = None,
    settle_ms: Annotated[
        int | None, typer.Option(help="Settle window in ms, 0 = NeMo's [TALLY_SETTLE_MS; 250].")
    ] = None,
    lease_ttl_s: Annotated[
        float | None, typer.Option(help="Writer lease in seconds [TALLY_LEASE_TTL_S; 30].")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="Log level [TALLY_LOG_LEVEL; INFO].")] = None,
    log_format: Annotated[str | None, typer.Option(help="text or json [TALLY_LOG_FORMAT; text].")] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate: serve TLS on both ports [TALLY_TLS_CERT].")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM key of --tls-cert [TALLY_TLS_KEY].")] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(help="PEM CA: require client certificates it signed (mTLS) [TALLY_TLS_CLIENT_CA]."),
    ] = None,
    metrics_auth: Annotated[
        bool | None,
        typer.Option(
            "--metrics-auth/--no-metrics-auth",
            help="/metrics needs a reader token when tokens are set [TALLY_METRICS_AUTH; off].",
        ),
    ] = None,
    journal: Annotated[
        bool | None,
        typer.Option(
            "--journal/--no-journal",
            help="Journal live writers so they survive a restart [TALLY_JOURNAL; on].",
        ),
    ] = None,
) -> None:
    """Run the coordinator (gRPC + HTTP) until SIGTERM."""
    flags: dict[str, Any] = {
        "data_dir": data_dir,
        "grpc_listen": grpc_listen,
        "http_listen": http_listen,
        "registry_url": registry_url,
        "store": store,
        "standby": standby,
        "settle_ms": settle_ms,
        "lease_ttl_s": lease_ttl_s,
        "log_level": log_level,
        "log_format": log_format,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "tls_client_ca": tls_client_ca,
        "metrics_auth": metrics_auth,
        "journal": journal,
    }
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
    app.command()(serve)


def main() -> None:
    """``python -m tally_server``: the ``tally`` command, as the console script runs it."""
    from tally.cli import main as tally_main

    tally_main()
