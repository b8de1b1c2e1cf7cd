"""docs/configuration.md documents every setting, and README's commands exist."""

from __future__ import annotations

import re
from pathlib import Path

from tally_server.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_documented() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields if f"`TALLY_{name.upper()}`" not in text]
    assert not missing


def test_the_settings_table_has_one_row_per_setting_with_its_flag() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-/]+)` \| `TALLY_([A-Z_]+)` \|", text, re.MULTILINE)
    flags = {env.lower(): flag for flag, env in rows}
    assert len(flags) == len(rows)  # one row each
    assert sorted(flags) == sorted(Settings.model_fields)  # every setting, and nothing else
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flags[name] == (f"{flag}/--no-{flag[2:]}" if field.annotation is bool else flag), name


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "./dev test" in readme.split("## A five-minute tour")[0]
    assert "./dev serve" in readme.split("## A five-minute tour")[0]
    assert "./dev test" in ci
