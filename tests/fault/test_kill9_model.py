"""One kill -9 trial of the fault campaign (bench/faults.py kill9), checked against its reference model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench._faultlib import kill9


@pytest.mark.parametrize("settle_ms", [0, 250])
def test_kill9_loses_no_acknowledged_completion_and_completes_nothing_unsent(
    tmp_path: Path, settle_ms: int
) -> None:
    """Writers split each source's tree across flushes; after kill -9 and a restart on the same data
    dir, every source a returned flush() covered is completed (live and in the NeMo files), and no
    source whose tree was only partly sent is."""
    result = kill9.run_trial(tmp_path, 0, random.Random(settle_ms), settle_ms, min_rounds=kill9.WRITERS)
    assert result.acknowledged > 0, "the kill came before any flush returned: nothing was checked"
    assert result.writers > 0, "every writer had finished before the kill: no crash under load"
    assert not result.lost, (
        f"{len(result.lost)} acknowledged completions lost, e.g. {sorted(result.lost)[:5]}"
    )
    assert not result.false, f"{len(result.false)} sources completed that were never fully sent"
