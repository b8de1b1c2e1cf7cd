"""The SDK is typed for its users: ``py.typed`` ships, and mypy checks user code against it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import tally

USER_CODE = textwrap.dedent(
    """
    import tally

    client = tally.Client("grpc://coordinator:50051")
    writer = client.writer("cp", on_mismatch="rest")
    reveal_type(writer.health().buffered)
    """
)


def test_py_typed_ships_with_the_package() -> None:
    assert (Path(tally.__file__).parent / "py.typed").is_file()


def test_mypy_checks_user_code_against_the_sdk(tmp_path: Path) -> None:
    # A fresh mypy run outside the repository's config: what a user's project sees.
    (tmp_path / "user.py").write_text(USER_CODE)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert "missing library stubs or py.typed marker" not in out, out
    assert 'Revealed type is "int"' in out, out
    # on_mismatch is a Literal: a typo is caught before the coordinator refuses it.
    assert 'Argument "on_mismatch" to "writer" of "Client" has incompatible type' in out, out
    assert "\"Literal['refuse', 'reset', 'ignore']\"" in out, out
