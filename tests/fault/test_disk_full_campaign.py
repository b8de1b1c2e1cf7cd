"""Disk full on a real 8 MB tmpfs (bench/faults.py disk_full, shortened). Needs root to mount it.

Completion files and the SQLite registry share the tmpfs; writers complete sources, the disk is
filled, then freed; later a writer's completion file is created with 4 KB free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench._faultlib import disk_full

pytestmark = pytest.mark.skipif(
    disk_full.unavailable_reason() is not None, reason=f"disk_full: {disk_full.unavailable_reason()}"
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Iterator[disk_full.DiskFullResult]:
    base: Path = tmp_path_factory.mktemp("diskfull")
    with disk_full.mounted(base) as tmpfs:
        yield disk_full.measure(base, tmpfs, full_phase_s=1.0, recovery_s=5.0)


def test_acknowledged_completions_survive_and_commits_recover(result: disk_full.DiskFullResult) -> None:
    assert len(result.acknowledged) > 0
    assert not result.lost
    assert result.recovery_s["w0"] is not None and result.recovery_s["w1"] is not None


def test_storage_failures_are_unavailable_and_say_the_disk_is_full(result: disk_full.DiskFullResult) -> None:
    assert result.internal == 0, result.codes
    assert result.open_while_full == "UNAVAILABLE"
    assert result.messages_while_full
    assert all(disk_full.says_disk_full(m) for m in result.messages_while_full), result.messages_while_full


def test_readyz_is_503_while_commits_fail(result: disk_full.DiskFullResult) -> None:
    assert result.readyz_while_full == 503


def test_a_file_created_on_a_nearly_full_disk_recovers_and_blocks_no_one(
    result: disk_full.DiskFullResult,
) -> None:
    assert result.recovery_s["late (file created on 4 KB)"] is not None
    assert result.others_after_late == {"w0": "OK", "w1": "OK"}


def test_failing_commits_do_not_flood_the_log(result: disk_full.DiskFullResult) -> None:
    assert result.log_bytes_per_s < 4096
    assert result.traceback_ends == {}  # a full disk is logged by its reason, never a traceback
