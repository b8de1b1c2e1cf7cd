"""Whether a transport ever reached its coordinator: a refused first connection fails at once.

A connection refused before the coordinator ever answered almost always means nothing is running
there (a new user who did not start one, a wrong port), and retrying it for the client's whole
timeout only hides that for half a minute. So each transport keeps a :class:`FirstContact`: until
the coordinator has answered once, a refused connection raises :class:`NeverReached`, which the
retry layers (``tally._retry``, a watch's reconnect) pass on instead of retrying. Once it has
answered, or broke an open connection mid-call (killed while answering), a refused connection is
an outage (a restart, an upgrade) and is retried as before.

A client that may start before its coordinator, or while it restarts (a SLURM task, a pod started
beside the coordinator), gives the first contact a grace period (``ClientConfig.connect_wait``,
``TALLY_CONNECT_WAIT``): refusals within it are retried like an outage.
"""

from __future__ import annotations

import time

from tally.errors import Unavailable


class NeverReached(Unavailable):
    """The first connection to a coordinator was refused: no retry, the message says what to do.

    Attributes:
        refused: The transport's own error for the refused connection.
    """

    def __init__(self, message: str, refused: Unavailable) -> None:
        super().__init__(message, refused.code, refused.details)
        self.refused = refused


def never_reached(where: str, refused: Unavailable) -> NeverReached:
    """The error for a refused first connection to ``where`` (``refused``: the transport's own)."""
    return NeverReached(
        f"no Tally coordinator is listening at {where} (connection refused); start one with `tally serve` "
        "(`./dev serve` in a checkout), or point TALLY_ADDRESS (the CLI's --address) at a running one "
        "(TALLY_CONNECT_WAIT=SECONDS waits that long for one that is starting)",
        refused,
    )


class FirstContact:
    """One transport's memory of whether its coordinator ever answered (a plain flag: races only
    ever set it), and how long after it was made a refusal still counts as "not up yet"."""

    def __init__(self, where: str, wait_s: float = 0.0) -> None:
        self.where = where
        self.answered = False
        self._wait_until = time.monotonic() + wait_s

    def ok(self) -> None:
        """The coordinator answered."""
        self.answered = True

    def broke(self, err: Unavailable) -> Unavailable:
        """A connection that was open broke mid-call (the coordinator killed or restarting while it
        answered): something listened there, so a refusal after this is an outage, retried, not
        "nothing listens here"; returns ``err``."""
        self.answered = True
        return err

    def failed(self, err: Unavailable, *, refused: bool) -> Unavailable:
        """The error to raise for a failed connection: ``err``, or :class:`NeverReached` when it
        was refused and the coordinator never answered."""
        if refused and not self.answered and time.monotonic() >= self._wait_until:
            return never_reached(self.where, err)
        return err
