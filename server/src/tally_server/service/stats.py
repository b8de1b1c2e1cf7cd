"""Cumulative counters of one coordinator, read by the metrics collector at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tally_server.domain.ledger import ApplyCounts


@dataclass
class ServiceStats:
    """Counters since the process started.

    Completions and anomalies are counted per checkpoint name (a checkpoint started over or
    deleted keeps its count: counters only grow). ``commit_observers`` are called after every
    group commit with (seconds, ops, sources).
    """

    deltas_applied: int = 0
    deltas_skipped: int = 0
    deltas_rewritten: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)  # by checkpoint
    completions: Counter[str] = field(default_factory=Counter)  # by checkpoint
    writers_opened: int = 0
    writers_expired: int = 0
    commit_failures: int = 0
    files_quarantined: int = 0
    batches_resent: int = 0
    writers_restored: int = 0
    deltas_refused: int = 0  # for sources another live writer held a claim on
    commit_observers: list[Callable[[float, int, int], None]] = field(default_factory=list)

    def count(self, checkpoint: str, counts: ApplyCounts) -> None:
        """Add one batch's counters (of a writer of ``checkpoint``) to the totals."""
        self.deltas_applied += counts.applied
        self.deltas_skipped += counts.skipped
        self.deltas_rewritten += counts.rewritten
        if counts.anomalies:
            self.anomalies[checkpoint] += counts.anomalies
