"""The domain core knows nothing of the wire or the disk (DESIGN §6)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import tally_server.domain

FORBIDDEN = ("grpc", "fastapi", "starlette", "lmdb", "sqlalchemy", "uvicorn", "asyncio")


def test_no_domain_module_imports_a_transport_a_store_or_the_event_loop() -> None:
    modules = [f"tally_server.domain.{m.name}" for m in pkgutil.iter_modules(tally_server.domain.__path__)]
    assert len(modules) >= 8
    probe = (
        "import sys\n"
        f"for name in {modules!r}: __import__(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r})))"
    )
    found = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert found.strip() == "[]"
