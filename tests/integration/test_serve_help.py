"""``tally serve --help`` lists every setting as a flag, with its environment variable and default,
and the flags reach the settings (issue 13). The real command in a pipe."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

import tally
from tally_server.settings import Settings
from tally_server.testing import running_server

TALLY = str(Path(sys.executable).parent / "tally")


def tally_serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env["COLUMNS"] = "80"
    return subprocess.run([TALLY, "serve", *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def help_text() -> str:
    result = tally_serve("--help")
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())  # the options' help wraps at 80 columns


def test_every_setting_has_a_flag_with_its_env_var_once_and_its_default(help_text: str) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"TALLY_{name.upper()}"
        if field.annotation is bool:
            assert f"{flag} / --no-{flag[2:]} " in help_text, name
        else:
            assert re.search(rf"{flag} <[a-z|]+> ", help_text), name
        hints = re.findall(rf"\[env var: {env}; default: ([^\]]+)\]", help_text)
        assert len(hints) == 1, (name, hints)  # once, and not eaten as markup
        assert help_text.count(f"env var: {env};") == 1, name
        (default,) = hints
        if field.default is None:
            assert default == "unset" or default.startswith(("unset: ", "the ", "HOSTNAME")), (name, default)
        else:  # the default shown is the setting's default, read back as the setting reads it
            assert pydantic.TypeAdapter(field.annotation).validate_python(default) == field.default, name
        # click wraps long words too (paths): compared without any whitespace.
        assert "".join(str(field.description).split()) in "".join(help_text.split()), name


def test_the_help_says_how_to_give_bearer_tokens(help_text: str) -> None:
    assert 'TALLY_TOKENS="TOKEN:ROLE,TOKEN:ROLE@PREFIX"' in help_text
    assert "--tokens-file" in help_text and "every user of the machine sees a command line" in help_text


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--shutdown-grace-s", "-1"],
            "--shutdown-grace-s -1.0 is not valid: input should be greater than or equal to 0",
        ),
        (["--max-name-bytes", "0"], "--max-name-bytes 0 is not valid: input should be greater than 0"),
        (["--tokens", "hunter2:emperor"], "--tokens is not valid: unknown role 'emperor' in token entry"),
        (["--tokens", "hunter2"], "--tokens is not valid: token entry 1 is not TOKEN:ROLE"),
    ],
)
def test_a_flag_the_old_cli_lacked_reaches_the_settings(tmp_path: Path, args: list[str], line: str) -> None:
    result = tally_serve("--data-dir", str(tmp_path / "d"), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"tally serve: {line}"), result.stderr
    assert "hunter2" not in result.stderr


def test_a_generated_flag_configures_a_running_coordinator() -> None:
    with (
        running_server(args=["--max-name-bytes", "12"]) as server,
        tally.Client(server.grpc_address) as client,
    ):
        client.import_completed("twelve-bytes", ["x"], import_id="imp")
        with pytest.raises(tally.InvalidArgument, match="over the limit of 12"):
            client.import_completed("thirteen-byte", ["x"], import_id="imp")
