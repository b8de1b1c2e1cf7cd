"""The fingerprint guard (DESIGN §2.5): refuse to resume a checkpoint with other inputs.

A writer may present a fingerprint, a map of named components (``{"pipeline": …, "input": …}``).
The first writer of a checkpoint records it; a later writer whose components differ is refused
naming each difference, unless it asks to reset the checkpoint or to ignore the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tally_server.domain.validation import describe
from tally_server.errors import FailedPrecondition, PermissionDenied

_ABSENT = "(absent)"


class OnMismatch(StrEnum):
    """What a writer asks for when its fingerprint differs from the checkpoint's."""

    REFUSE = "refuse"
    RESET = "reset"
    IGNORE = "ignore"


@dataclass(frozen=True)
class Mismatch:
    """How a presented fingerprint differs from the recorded one."""

    differing: list[str]  # component names, sorted
    detail: str  # "name: recorded 'a', this writer 'b'; …"


def compare(recorded: dict[str, str], presented: dict[str, str]) -> Mismatch | None:
    """The difference, or None when there is nothing to compare or nothing differs."""
    if not recorded or not presented:
        return None  # the first fingerprint is recorded, an absent one is not checked
    differing = sorted(k for k in recorded.keys() | presented.keys() if recorded.get(k) != presented.get(k))
    if not differing:
        return None
    detail = "; ".join(
        f"{k}: recorded {describe(recorded.get(k, _ABSENT))}, "
        f"this writer {describe(presented.get(k, _ABSENT))}"
        for k in differing
    )
    return Mismatch(differing, detail)


def decide(checkpoint: str, mismatch: Mismatch, on_mismatch: OnMismatch, *, may_reset: bool) -> OnMismatch:
    """What to do about a mismatch: IGNORE or RESET, or raise the refusal.

    Raises:
        PermissionDenied: a reset was asked for by a caller that may not reset the checkpoint.
        FailedPrecondition: the writer did not ask to reset or ignore.
    """
    if on_mismatch is OnMismatch.IGNORE:
        return OnMismatch.IGNORE
    if on_mismatch is OnMismatch.RESET:
        if not may_reset:
            raise PermissionDenied(
                f"checkpoint {checkpoint!r} was started with a different fingerprint ({mismatch.detail}) "
                "and on_mismatch='reset' would start it over, but resetting needs the admin role on it: "
                "open with an admin token, have an admin run 'tally reset', or use a new checkpoint name",
                differing=mismatch.differing,
            )
        return OnMismatch.RESET
    raise FailedPrecondition(
        f"checkpoint {checkpoint!r} was started with a different fingerprint: {mismatch.detail}. Resuming "
        "it with other inputs could skip work that was never done for them. Use a new checkpoint name, "
        "or open with on_mismatch='reset' to start this one over (its files go to the trash) or "
        "on_mismatch='ignore' if the difference does not matter",
        differing=mismatch.differing,
    )
