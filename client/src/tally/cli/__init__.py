"""The ``tally`` command: the operator commands, shipped with the SDK as ``tally-client[cli]``.

``status``, ``watch``, ``remaining``, ``writers``, ``events``, ``reset``, ``export``, ``import`` and
``inspect`` are clients of the SDK (``replay``, a trace through the counting rules, needs no
coordinator); they need typer, rich and lmdb (the ``[cli]`` extra) but nothing of the server, so an
operator's laptop runs them without FastAPI, SQLAlchemy or psycopg. ``tally serve`` belongs to the
server: the ``tally-server`` distribution adds it through the ``tally.commands`` entry-point group.
``import tally`` never imports this package.
"""

from __future__ import annotations

import sys

INSTALL_HINT = "tally: the command line is the SDK's extra; install it with: pip install 'tally-client[cli]'"


def main() -> None:
    """Run the ``tally`` command (the console script)."""
    try:
        from tally.cli.app import build_app
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in ("typer", "click", "rich", "lmdb"):
            raise
        print(f"{INSTALL_HINT} ({missing} is missing)", file=sys.stderr)
        raise SystemExit(1) from None
    build_app()()
