"""What a writer's batch does to its checkpoint: the counting rules joined to the live completed set.

The service drives these steps around its commits; the property test drives the very same steps
against a reference model, with persistence made instant. Order matters and is kept here:

* a source un-completed by an anomaly leaves the live set at once (a doubtful completion is never
  shown), before its un-complete is committed;
* a source that completes is committed first and joins the live set only once durable
  (:func:`made_durable`), so nobody ever sees a completion that a crash could take back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tally_server.domain.checkpoint import CompletedSet
from tally_server.domain.ledger import Anomaly, ApplyCounts, Delta, WriterLedger


@dataclass
class BatchEffects:
    """What the service must do after a batch, in this order."""

    counts: ApplyCounts
    anomalies: list[Anomaly] = field(default_factory=list)
    uncomplete: list[str] = field(default_factory=list)  # commit the delete in every file
    complete: list[str] = field(default_factory=list)  # commit to the writer's file, then made_durable
    hits: list[str] = field(default_factory=list)  # see BatchResult.hits (journaled with the batch)


def apply_batch(
    ledger: WriterLedger, completed: CompletedSet, batch: Sequence[Delta], now: float
) -> BatchEffects:
    """Apply ``batch`` under the rules; anomalies leave the live set now; returns what to commit."""
    result = ledger.apply(batch, now)
    uncomplete = list(dict.fromkeys(a.source_id for a in result.anomalies))
    if uncomplete:
        completed.discard_many(uncomplete)
    complete = ledger.mark_completing(result.complete_now)
    return BatchEffects(result.counts, result.anomalies, uncomplete, complete, result.hits)


def settle_due(ledger: WriterLedger, now: float) -> list[str]:
    """Sources whose settle window ran out: they complete (commit them, then made_durable)."""
    return ledger.mark_completing(ledger.due(now))


def settle_all(ledger: WriterLedger) -> list[str]:
    """The writer closes: no delta can come any more, so every settling source completes."""
    return ledger.mark_completing(ledger.take_all_settling())


def made_durable(
    completed: CompletedSet, sources: Iterable[str], origin: str | None = None, *, distinct: bool = False
) -> None:
    """The commit of ``sources`` (to ``origin``'s file) is durable: everyone sees them completed.

    ``distinct``: no id comes twice in ``sources`` (what ``mark_completing`` returned).
    """
    completed.add(sources, origin, distinct=distinct)


def commit_failed(ledger: WriterLedger, sources: Iterable[str], now: float) -> None:
    """Persisting failed: the sources are not completed; they settle again and are retried."""
    ledger.revert_completing(sources, now)


def uncomplete_durable(completed: CompletedSet, sources: Iterable[str]) -> None:
    """The un-complete is durable: drop the sources from the live set again.

    A completion committed before the delete may have re-added them meanwhile; the later anomaly wins.
    """
    completed.discard_many(sources)
