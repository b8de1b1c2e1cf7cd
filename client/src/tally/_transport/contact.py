"""Whether a transport ever reached its coordinator: a refused first connection fails at once.

A connection refused before the coordinator ever answered almost always means nothing is running
there (a new user who did not start one, a wrong port), and retrying it for the client's whole
timeout only hides that for half a minute. So each transport keeps a :class:`FirstContact`: until
the coordinator has answered once, a refused connection raises :class:`NeverReached`, which the
retry layers (``tally._retry``, a watch's reconnect) pass on instead of retrying. Once it has
answered, a refused connection is an outage (a restart, an upgrade) and is retried as before.
"""

from __future__ import annotations

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
        "(`./dev serve` in a checkout), or point TALLY_ADDRESS (the CLI's --address) at a running one",
        refused,
    )


class FirstContact:
    """One transport's memory of whether its coordinator ever answered (a plain flag: races only
    ever set it)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.answered = False

    def ok(self) -> None:
        """The coordinator answered."""
        self.answered = True

    def failed(self, err: Unavailable, *, refused: bool) -> Unavailable:
        """The error to raise for a failed connection: ``err``, or :class:`NeverReached` when it
        was refused and the coordinator never answered."""
        if refused and not self.answered:
            return never_reached(self.where, err)
        return err
