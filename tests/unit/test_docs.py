"""docs/configuration.md documents every setting, and README's commands exist."""

from __future__ import annotations

from pathlib import Path

from tally_server.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_documented() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields if f"`TALLY_{name.upper()}`" not in text]
    assert not missing


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "./dev test" in readme.split("## A five-minute tour")[0]
    assert "./dev serve" in readme.split("## A five-minute tour")[0]
    assert "./dev test" in ci
