"""Claims with fencing tokens (issue #12): which live writer works on a source, and which may not.

A writer acquires sources before working on them. Each source it gets is *acquired* with a fencing
token, larger than any token given for that source before (the registry keeps the highest, durably,
before the answer leaves); a source another live writer holds is *held* (by whom, until when);
completed and failed sources are said to be so and are not claimed. A claim ends when its source
completes, its writer closes, or its writer's lease runs out (a reset closes the writers, so it
ends theirs too); another writer can then acquire the source, with a larger token.

While a source is held, deltas for it from any other writer are refused: counted, recorded as an
event, never applied, never journaled. An output store fences late writes with
:meth:`Claims.token_is_current` (Kleppmann's fencing tokens).

Live claims are kept in memory per checkpoint and in the registry; after a restart the claims of
the writers the journal brings back are live again, the others are released.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tally_server.domain import validation
from tally_server.domain.checkpoint import Checkpoint, Claim
from tally_server.domain.events import EventKind
from tally_server.domain.ledger import Delta
from tally_server.domain.ports import ClaimRecord
from tally_server.domain.words import count
from tally_server.errors import Unavailable
from tally_server.service.checkpoints import CheckpointTable
from tally_server.service.core import Core
from tally_server.service.sessions import Session
from tally_server.service.views import ClaimView, TokenCheck

log = logging.getLogger(__name__)

ACQUIRED = "acquired"
HELD = "held"
COMPLETED = "completed"
FAILED = "failed"
# Refused deltas named in one event (the event counts them all).
_NAMED_IN_EVENT = 10


class Claims:
    """Acquire sources, check fencing tokens, and end claims with their sources and writers."""

    def __init__(self, core: Core, checkpoints: CheckpointTable) -> None:
        self._core = core
        self._checkpoints = checkpoints

    async def restore(self, records: Sequence[ClaimRecord], restored: Sequence[Session]) -> None:
        """At start: the live claims of writers the journal brought back; the others end."""
        sessions = {s.handle: s for s in restored}
        ended: dict[tuple[str, str], list[str]] = {}
        for record in records:
            session = sessions.get(record.holder)
            cp = self._checkpoints.known.get(record.checkpoint)
            done = cp is None or (cp.completed is not None and record.source_id in cp.completed)
            if session is None or done or session.checkpoint != record.checkpoint:
                ended.setdefault((record.checkpoint, record.holder), []).append(record.source_id)
                continue
            assert cp is not None
            cp.claims[record.source_id] = Claim(session.handle, session.writer_id, record.token)
            session.claimed.add(record.source_id)
        for (checkpoint, holder), sources in ended.items():
            self._release_behind(checkpoint, holder, sources)

    async def acquire(self, cp: Checkpoint, session: Session, source_ids: Sequence[str]) -> list[ClaimView]:
        """Claim sources for the writer: one answer per distinct source, in the order asked."""
        core = self._core
        asked = list(dict.fromkeys(validation.source_ids(list(source_ids), core.limits)))
        completed = cp.ids()
        budget = cp.max_attempts
        answers: dict[str, ClaimView] = {}
        wanted: list[str] = []
        for sid in asked:
            claim = cp.claims.get(sid)
            if sid in completed:
                answers[sid] = ClaimView(sid, COMPLETED)
            elif budget and cp.failures.get(sid, 0) >= budget:
                answers[sid] = ClaimView(sid, FAILED)
            elif claim is None:
                wanted.append(sid)
            elif claim.handle != session.handle:
                answers[sid] = ClaimView(sid, HELD, holder=claim.writer_id, until=self._until(claim))
            elif claim.token:
                answers[sid] = ClaimView(sid, ACQUIRED, token=claim.token)
            else:  # this writer's acquire of it still being recorded: wait for it below
                wanted.append(sid)
        mine = [sid for sid in wanted if sid not in cp.claims]
        # Reserve before awaiting: a concurrent acquire of another writer sees them held.
        for sid in mine:
            cp.claims[sid] = Claim(session.handle, session.writer_id)
            session.claimed.add(sid)
        if mine:
            try:
                tokens = await core.registry_write(
                    core.registry.take_claims, cp.name, mine, session.handle, session.writer_id, core.wall()
                )
            except BaseException:
                for sid in mine:
                    self._drop(cp, session, sid)
                raise
            for sid in mine:
                claim = cp.claims.get(sid)
                if claim is not None and claim.handle == session.handle:
                    claim.token = tokens[sid]
        for sid in wanted:
            answers[sid] = self._answer(cp, session, sid)
        return [answers[sid] for sid in asked]

    def _answer(self, cp: Checkpoint, session: Session, sid: str) -> ClaimView:
        """Where a source stands for this writer after its claim was recorded (or ended meanwhile)."""
        claim = cp.claims.get(sid)
        if claim is not None and claim.handle == session.handle and claim.token:
            return ClaimView(sid, ACQUIRED, token=claim.token)
        if claim is not None and claim.handle != session.handle:
            return ClaimView(sid, HELD, holder=claim.writer_id, until=self._until(claim))
        if cp.completed is not None and sid in cp.completed:
            return ClaimView(sid, COMPLETED)  # it completed while the claim was being recorded
        raise Unavailable(
            f"the claim on source {validation.describe(sid)} is still being recorded by another acquire of "
            "this writer, or this writer closed meanwhile; acquire it again"
        )

    def _until(self, claim: Claim) -> float:
        """When the holder's lease runs out unless renewed, in Unix time."""
        core = self._core
        holder = core.sessions.get(claim.handle)
        if holder is None:
            return core.wall()
        return core.wall() + max(holder.lease_deadline - core.clock(), 0.0)

    async def token_is_current(self, checkpoint: str, source_id: str, token: int) -> TokenCheck:
        """Whether ``token`` is the live claim's on the source (its writer still holds it)."""
        core = self._core
        validation.checkpoint_name(checkpoint, core.limits)
        validation.source_id(source_id, core.limits)
        cp = await self._checkpoints.existing(checkpoint)
        claim = cp.claims.get(source_id)
        live = claim.token if claim is not None else 0
        return TokenCheck(bool(live) and live == token, live)

    def refuse_held(self, cp: Checkpoint, session: Session, batch: Sequence[Delta]) -> Sequence[Delta]:
        """The batch without deltas for sources another live writer holds; those are counted, recorded."""
        claims = cp.claims
        handle = session.handle
        kept = [d for d in batch if (c := claims.get(d[1])) is None or c.handle == handle]
        refused = len(batch) - len(kept)
        if not refused:
            return batch
        self._core.stats.deltas_refused += refused
        sources = sorted({d[1] for d in batch if (c := claims.get(d[1])) is not None and c.handle != handle})
        named = ", ".join(f"{sid} (held by {claims[sid].writer_id})" for sid in sources[:_NAMED_IN_EVENT]) + (
            " ..." if len(sources) > _NAMED_IN_EVENT else ""
        )
        self._core.event(
            cp.name,
            EventKind.DELTAS_REFUSED,
            f"{count(refused, 'delta')} of writer {session.writer_id} for {count(len(sources), 'source')} "
            f"another live writer holds {'was' if refused == 1 else 'were'} refused, not applied: {named}. "
            "Acquire sources before working on them",
            session.writer_id,
            refused=refused,
            sources=len(sources),
        )
        return kept

    def completed(self, cp: Checkpoint, sources: Sequence[str]) -> None:
        """Sources completed: their claims end (in the registry behind the answer)."""
        ended: dict[str, list[str]] = {}
        for sid in sources:
            claim = cp.claims.pop(sid, None)
            if claim is None:
                continue
            holder = self._core.sessions.get(claim.handle)
            if holder is not None:
                holder.claimed.discard(sid)
            ended.setdefault(claim.handle, []).append(sid)
        for handle, sids in ended.items():
            self._release_behind(cp.name, handle, sids)

    def writer_ended(self, cp: Checkpoint, session: Session) -> None:
        """A writer closed, expired or was reset: every claim it held ends."""
        if not session.claimed:
            return
        for sid in session.claimed:
            claim = cp.claims.get(sid)
            if claim is not None and claim.handle == session.handle:
                del cp.claims[sid]
        session.claimed.clear()
        self._release_behind(cp.name, session.handle, None)

    def _drop(self, cp: Checkpoint, session: Session, sid: str) -> None:
        claim = cp.claims.get(sid)
        if claim is not None and claim.handle == session.handle:
            del cp.claims[sid]
        session.claimed.discard(sid)

    def _release_behind(self, checkpoint: str, handle: str, sources: Sequence[str] | None) -> None:
        """Mark claims released in the registry, behind the answer.

        If that write is lost, the next start releases them: their writer is gone (it is not
        brought back) or their source is completed.
        """
        registry = self._core.registry
        self._core.write_behind(
            f"record the end of claims on {checkpoint}", registry.release_claims, checkpoint, handle, sources
        )
